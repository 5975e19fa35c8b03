"""Child processes of a benchmark phase, started together so the phase times only the work.

A :class:`Phase` spawns K children (``spawn``, not ``fork``: no copied connections or broker
threads). Each does its setup (connects, warms its producer, reads its share of the rows), says it
is ready, and waits; the parent notes ``t0`` and lets them all go at once; each child reports its
progress through a shared counter and, when told to stop or done, one result dict. Start-up costs
(interpreter, imports, connections, broker metadata) therefore never count in a rate.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.queues
import multiprocessing.sharedctypes
import os
import queue
import resource
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from saga_engine import clock, errors
from saga_engine.outbox.relay import BatchOutcome, Relay

if TYPE_CHECKING:
    from sqlalchemy import Connection

    from saga_engine.outbox.writer import OutboxWriter

Spec = dict[str, Any]
Result = dict[str, Any]


@dataclasses.dataclass
class Channels:
    """What a child shares with the parent (all picklable for ``spawn``)."""

    index: int
    ready: Any  # multiprocessing Queue of (index, pid | error text)
    results: Any  # multiprocessing Queue of (index, result)
    go: Any  # multiprocessing Event: start the timed work
    stop: Any  # multiprocessing Event: finish and report
    progress: Any  # multiprocessing Value('q'): units of work done so far


class Phase:
    """K children running ``kind`` (a function of this module) with one spec each."""

    def __init__(self, kind: str, specs: Sequence[Spec], *, setup_timeout: float = 60.0) -> None:
        if kind not in CHILDREN:
            raise ValueError(f"unknown child kind {kind!r}")
        ctx = multiprocessing.get_context("spawn")
        self.kind = kind
        self.setup_timeout = setup_timeout
        self.ready: Any = ctx.Queue()
        self.results: Any = ctx.Queue()
        self.go_event: Any = ctx.Event()
        self.stop_event: Any = ctx.Event()
        self.counters = [ctx.Value("q", 0) for _ in specs]
        self.processes = [
            ctx.Process(
                target=child_main,
                args=(
                    kind,
                    spec,
                    Channels(
                        i,
                        self.ready,
                        self.results,
                        self.go_event,
                        self.stop_event,
                        self.counters[i],
                    ),
                ),
                name=f"bench-{kind}-{i}",
                daemon=True,
            )
            for i, spec in enumerate(specs)
        ]
        self.pids: list[int] = []

    def start(self) -> None:
        """Spawn the children and wait until every one is ready."""
        for process in self.processes:
            process.start()
        deadline = time.monotonic() + self.setup_timeout
        while len(self.pids) < len(self.processes):
            try:
                _index, message = self.ready.get(timeout=0.5)
            except queue.Empty:
                self._check_alive()
                if time.monotonic() > deadline:
                    self.kill()
                    raise errors.SagaEngineError(
                        f"{self.kind} children not ready in time"
                    ) from None
                continue
            if isinstance(message, str):
                self.kill()
                raise errors.SagaEngineError(f"a {self.kind} child failed to start:\n{message}")
            self.pids.append(int(message))

    def go(self) -> datetime:
        """Let every child start its timed work; returns t0 (naive UTC, like the engine's stamps)."""
        t0 = clock.SYSTEM.now()
        self.go_event.set()
        return t0

    def progress(self) -> int:
        return sum(int(counter.value) for counter in self.counters)

    def wait_progress(self, total: int, timeout: float) -> bool:
        """Wait until the children together did ``total`` units; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.progress() < total:
            if time.monotonic() > deadline:
                return False
            self._check_alive()
            time.sleep(0.01)
        return True

    def finish(self, timeout: float = 120.0) -> list[Result]:
        """Tell the children to stop; their results, in child order."""
        self.stop_event.set()
        results: dict[int, Result] = {}
        deadline = time.monotonic() + timeout
        while len(results) < len(self.processes):
            try:
                index, result = self.results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    self.kill()
                    raise errors.SagaEngineError(f"{self.kind} children did not report") from None
                self._check_alive()
                continue
            if "error" in result:
                self.kill()
                raise errors.SagaEngineError(f"a {self.kind} child failed:\n{result['error']}")
            results[index] = result
        for process in self.processes:
            process.join(10)
        return [results[i] for i in range(len(self.processes))]

    def _check_alive(self) -> None:
        """Raise if a child died (a child that exits normally has put its result first)."""
        for process in self.processes:
            if process.exitcode not in (None, 0):
                self.kill()
                raise errors.SagaEngineError(
                    f"{process.name} exited with status {process.exitcode}"
                )

    def kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(5)


def child_main(kind: str, spec: Spec, channels: Channels) -> None:
    """Entry point of every child: run ``kind`` and report its result (or its traceback)."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # kafka-python 3 warns whenever a task holds its IO loop over 100 ms, which a loaded
    # two-core machine does all the time; real failures still show as errors and results.
    logging.getLogger("kafka").setLevel(logging.ERROR)
    started = False

    def ready() -> None:
        nonlocal started
        started = True
        channels.ready.put((channels.index, os.getpid()))
        channels.go.wait()

    try:
        result = CHILDREN[kind](spec, channels, ready)
        result.setdefault("cpu_s", own_cpu_seconds())
        result.setdefault("peak_rss_mb", own_peak_rss_mb())
        channels.results.put((channels.index, result))
    except BaseException:
        text = traceback.format_exc()
        target = channels.results if started else channels.ready
        target.put((channels.index, {"error": text} if started else text))


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def own_peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# -- the children ------------------------------------------------------------------------------------

Ready = Callable[[], None]


def relay_child(spec: Spec, ch: Channels, ready: Ready) -> Result:
    """One relay (the engine's :class:`Relay`, as ``saga-engine relay`` runs it) until stopped."""
    from saga_engine import db, transport
    from saga_engine.bench.nulltransport import NullTransport
    from saga_engine.outbox.relay import RelayConfig, relay_engine, relay_wakeup

    config = RelayConfig(
        batch_size=spec["batch_size"],
        poll_interval=spec["poll_interval"],
        on_sent=spec.get("on_sent", "auto"),  # the engine's default unless the bench says
    )
    engine = relay_engine(spec["db"], config.pool_size)
    db.check_connection(engine)
    broker = transport.from_url(spec["broker"]) if spec.get("broker") else NullTransport()
    if spec.get("warmup_topic"):
        warm_up(broker, spec["warmup_topic"])
    if spec.get("ack_log"):
        log_acks(spec["ack_log"])
    wakeup = relay_wakeup(engine) if spec.get("notify", True) else None
    relay = TimedRelay(engine, broker, config, wakeup=wakeup)
    ready()
    stop = threading.Event()
    runner = threading.Thread(target=_profiled(relay.run, spec.get("profile")), args=(stop,))
    cpu_before = own_cpu_seconds()
    runner.start()
    while not ch.stop.wait(0.01):
        ch.progress.value = relay.stats.published
    stop.set()
    runner.join()
    ch.progress.value = relay.stats.published
    cpu = own_cpu_seconds() - cpu_before
    broker.close()
    engine.dispose()
    return {**dataclasses.asdict(relay.stats), "cpu_s": cpu, "passes": relay.passes}


class TimedRelay(Relay):
    """The engine's relay, noting when each pass committed and how many rows it published: a
    phase's rate and drain times come from these, whether its rows are kept or deleted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.passes: list[tuple[str, int]] = []

    def run_once(self, limit: int | None = None) -> BatchOutcome:
        outcome = super().run_once(limit)
        if outcome.published:
            self.passes.append((clock.SYSTEM.now().isoformat(), outcome.published))
        return outcome


def log_acks(path: str) -> None:
    """Append the Kafka batch producer's acknowledgements (one JSON line each) to ``path``."""
    import logging

    from saga_engine.transport.kafka_batch import ack_log

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    ack_log.addHandler(handler)
    ack_log.setLevel(logging.DEBUG)
    ack_log.propagate = False


def warm_up(broker: Any, topic: str) -> None:
    """Connect the producer and fetch the topic's metadata before the clock starts."""
    from saga_engine.transport.base import OutgoingMessage

    message = OutgoingMessage(f"warmup-{os.getpid()}", topic, "warmup", b'{"warmup":true}')
    (result,) = broker.publish([message], 20.0)
    if not result.ok:
        raise errors.TransportError(f"warm-up publish failed: {result.error}")


def _profiled(target: Callable[[threading.Event], None], path: str | None) -> Any:
    """``target``, under pyinstrument when ``path`` is given (text report written there)."""
    if not path:
        return target

    def run(stop: threading.Event) -> None:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005)
        profiler.start()
        try:
            target(stop)
        finally:
            profiler.stop()
            Path(path).write_text(profiler.output_text(unicode=False, color=False, show_all=False))

    return run


def claim_mark_child(spec: Spec, ch: Channels, ready: Ready) -> Result:
    """The database's ceiling: SKIP LOCKED claim of a batch, then mark it SENT (or archive or
    delete it, as the relay's ``on_sent`` says, with the relay's own statements); no broker, no
    order guard, no message building."""
    import sqlalchemy as sa

    from saga_engine import db, schema
    from saga_engine.outbox.claim import ROW_COLUMNS
    from saga_engine.outbox.relay import mark_statements

    t = schema.outbox
    engine = db.create_engine(spec["db"], pool_size=1)
    db.check_connection(engine)
    ready()
    cpu_before, done = own_cpu_seconds(), 0
    passes: list[tuple[str, int]] = []
    on_sent = spec["on_sent"]  # decided for the database: "auto" would settle nothing here
    while True:
        now = clock.SYSTEM.now()
        with engine.begin() as conn:
            rows = conn.execute(
                sa.select(*ROW_COLUMNS)
                .where(t.c.status == schema.OutboxStatus.PENDING, t.c.next_retry_at <= now)
                .order_by(t.c.id)
                .limit(spec["batch_size"])
                .with_for_update(skip_locked=True)
            ).all()
            if rows:
                params = {"ids": [row.id for row in rows], "now": now, "token": None}
                mark_statements(conn, owned=False).settle(conn, on_sent, params)
        if rows:
            passes.append((clock.SYSTEM.now().isoformat(), len(rows)))
        done += len(rows)
        ch.progress.value = done
        if not rows and not _any_pending(engine):
            break
    cpu = own_cpu_seconds() - cpu_before
    engine.dispose()
    return {"rows": done, "cpu_s": cpu, "passes": passes}


def _any_pending(engine: Any) -> bool:
    import sqlalchemy as sa

    from saga_engine import schema

    t = schema.outbox
    with engine.connect() as conn:
        first = conn.execute(
            sa.select(t.c.id).where(t.c.status == schema.OutboxStatus.PENDING).limit(1)
        ).first()
    return first is not None


def producer_child(spec: Spec, ch: Channels, ready: Ready) -> Result:
    """The broker's ceiling: kafka-python producing this child's share of the same messages
    (same keys and bytes as the relay sends) with acks=all, as fast as it can."""
    import sqlalchemy as sa

    from saga_engine import db
    from saga_engine.bench import env
    from saga_engine.outbox.claim import ROW_COLUMNS
    from saga_engine.outbox.relay import to_outgoing

    # The rows as written (``source``, the bench's copy): a relay that ran just before may have
    # archived or deleted the outbox's.
    source = sa.table(spec["source"], *(sa.column(c.name) for c in ROW_COLUMNS))
    engine = db.create_engine(spec["db"], pool_size=1)
    share, of = ch.index, spec["children"]
    with engine.connect() as conn:
        rows: list[Any] = conn.execute(
            sa.select(*source.c).where(source.c.id % of == share).order_by(source.c.id)
        ).all()  # type: ignore[assignment, unused-ignore]
    engine.dispose()
    messages = [to_outgoing(row) for row in rows]
    kafka: Any = env.kafka_module()
    producer = kafka.KafkaProducer(**producer_config(spec["bootstrap"]))
    topic = spec["topic"]
    producer.send(topic, key=b"warmup", value=b'{"warmup":true}').get(timeout=20)
    ready()
    cpu_before = own_cpu_seconds()
    futures = [
        producer.send(topic, key=m.partition_key.encode(), value=m.value, headers=list(m.headers))
        for m in messages
    ]
    producer.flush(timeout=120)
    failed = 0
    for future in futures:
        try:
            future.get(timeout=60)
        except Exception:
            failed += 1
    end = clock.SYSTEM.now()
    ch.progress.value = len(messages) - failed
    cpu = own_cpu_seconds() - cpu_before
    ch.stop.wait(120)
    producer.close(timeout=5)
    return {"messages": len(messages), "failed": failed, "end": end.isoformat(), "cpu_s": cpu}


def producer_config(bootstrap: str) -> dict[str, Any]:
    """The producer settings of the engine's Kafka transport (saga_engine/transport/kafka.py):
    acks=all with idempotence, 5 in flight, 5 ms linger, 512 KiB batches."""
    return {
        "bootstrap_servers": [bootstrap],
        "client_id": "saga-engine-bench-raw",
        "acks": "all",
        "enable_idempotence": True,
        "max_in_flight_requests_per_connection": 5,
        "linger_ms": 5,
        "batch_size": 512 * 1024,
        "request_timeout_ms": 30_000,
    }


def writer_child(spec: Spec, ch: Channels, ready: Ready) -> Result:
    """An open-loop writer for the latency bench: ``threads`` streams, each committing one business
    transaction per message (a ``bench_orders`` row plus its outbox message) on a fixed schedule,
    so this process offers ``rate`` messages per second in all; notes when each commit returned.

    Threads, because a stream spends most of its time waiting for the database (psycopg releases
    the GIL), and one stream per process could not offer 1,000 commits/s on two cores."""
    from saga_engine import db

    threads = int(spec.get("threads", 4))
    engine = db.create_engine(spec["db"], pool_size=threads)
    db.check_connection(engine)
    streams = [_Stream(spec, ch, engine, i, threads) for i in range(threads)]
    ready()
    cpu_before = own_cpu_seconds()
    workers = [threading.Thread(target=stream.run) for stream in streams]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    cpu = own_cpu_seconds() - cpu_before
    engine.dispose()
    errors_ = [stream.error for stream in streams if stream.error]
    if errors_:
        raise RuntimeError(errors_[0])
    return {
        "commits": [c for stream in streams for c in stream.commits],
        "behind_s": max(stream.behind for stream in streams),
        "cpu_s": cpu,
    }


class _Stream:
    """One writer thread: message i of its share is due at start + i / rate."""

    def __init__(self, spec: Spec, ch: Channels, engine: Any, index: int, of: int) -> None:
        self.spec, self.ch, self.engine = spec, ch, engine
        self.rate = float(spec["rate"]) / of
        self.total = int(float(spec["rate"]) * float(spec["seconds"])) // of
        # Streams of all writers interleave evenly: this one's phase within a message interval.
        self.phase = (spec.get("offset", 0.0) + index) / of
        self.name = f"{ch.index}.{index}"
        self.commits: list[tuple[str, float]] = []
        self.behind = 0.0
        self.error = ""

    def run(self) -> None:
        from saga_engine.outbox.writer import OutboxWriter

        writer = OutboxWriter()
        start = time.monotonic() + self.phase / self.rate
        try:
            # One connection for the whole run: a pool checkout and return per message cost
            # about 0.1 ms of client CPU, which the writers would take from the relay they measure.
            with self.engine.connect() as conn:
                self._write(conn, writer, start)
        except Exception as error:
            self.error = f"{type(error).__name__}: {error}"
        self.behind = max(0.0, time.monotonic() - (start + self.total / self.rate))

    def _write(self, conn: Connection, writer: OutboxWriter, start: float) -> None:
        from saga_engine.bench import workload

        for i in range(self.total):
            delay = start + i / self.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            key = f"{self.spec.get('key_prefix', 'order')}-{self.name}-{i}"
            envelope = workload.envelope(self.spec["topic"], key, self.spec["payload_bytes"])
            with conn.begin():
                workload.insert_order(conn, key)
                writer.add(conn, envelope)
            self.commits.append((envelope.message_id, time.time()))
            with self.ch.progress.get_lock():
                self.ch.progress.value += 1
            if self.ch.stop.is_set():
                break


def bulk_writer_child(spec: Spec, ch: Channels, ready: Ready) -> Result:
    """This child's share of the relay bench's messages, through ``OutboxWriter.add_many``: the
    transactions ``t`` with ``t % children == index``, ``per_transaction`` messages each."""
    from saga_engine import db
    from saga_engine.bench import workload
    from saga_engine.outbox.writer import OutboxWriter

    engine = db.create_engine(spec["db"], pool_size=1)
    db.check_connection(engine)
    writer = OutboxWriter()
    total, per_tx, per_key = spec["messages"], spec["per_transaction"], spec["per_key"]
    durations: list[float] = []
    ready()
    done = 0
    for first in range(ch.index * per_tx, total, spec["children"] * per_tx):
        envelopes = [
            workload.envelope(
                spec["topic"], workload.order_key(i // per_key), spec["payload_bytes"]
            )
            for i in range(first, min(total, first + per_tx))
        ]
        began = time.perf_counter()
        with engine.begin() as conn:
            writer.add_many(conn, envelopes)
        durations.append(time.perf_counter() - began)
        done += len(envelopes)
        ch.progress.value = done
    engine.dispose()
    return {"messages": done, "durations": durations, "end": clock.SYSTEM.now().isoformat()}


CHILDREN: dict[str, Callable[[Spec, Channels, Ready], Result]] = {
    "relay": relay_child,
    "claim_mark": claim_mark_child,
    "producer": producer_child,
    "writer": writer_child,
    "bulk_writer": bulk_writer_child,
}
