"""``saga-engine bench saga``: the order saga end to end on K worker processes, and the peer.

The workers are ``saga-engine worker --app sagas.app:app`` processes sharing one scratch database
and one Kafka broker, laid out as services (:data:`LAYOUTS`): the first runs the orchestrator,
relay, deadlines and cleanup, the others the participants. After a warm-up (every consumer group
joined, every producer connected), the bench places N orders, each in its own transaction, one in
ten declined at payment so the saga compensates, and waits until every saga has ended. Figures:
sagas/s from the first saga's ``created_at`` to the last one's ``ended_at``; saga latency
(``ended_at - created_at``) p50/p99; outbox messages per saga; the workers' peak RSS; CPU per saga
of the workers, the placing, the broker it started, the whole machine and the rest (the database,
when it runs here); states, duplicates, dead letters and the saga's business invariants.

``--peer temporal`` then runs the same saga on Temporal's dev server (in memory) in the same run and
prints the ratio. Both are measured on the same machine, one after the other.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import math
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from saga_engine import db, errors, schema, worker
from saga_engine.bench import env
from saga_engine.bench.report import Report, percentile
from saga_engine.consumer import by_message_id
from saga_engine.messages import Envelope
from saga_engine.outbox.claim import ROW_COLUMNS
from saga_engine.outbox.relay import to_outgoing
from saga_engine.participant import ParticipantService

s = schema.saga_instances
TARGET_VS_TEMPORAL = 30.0
WARMUP_SAGAS = 20
#: ``--saga``: the app the workers run and the module whose saga the bench places, by name.
#: ``full`` is the example with its business data; ``outline`` has the Temporal peer's steps and,
#: like the peer's activities, no business work (see sagas/order_outline.py).
SAGAS = {
    "full": ("sagas.app:app", "sagas.order_fulfilment"),
    "outline": ("sagas.order_outline:app", "sagas.order_outline"),
}


#: ``--layout``: the roles of the ``--workers`` processes.
#: ``services``: as the services would run them. The first worker runs the orchestrating service's
#: roles (``orchestrator``, ``relay``, ``deadlines``, ``cleanup``; its relay delivers the one
#: outbox every service of the bench writes to), the others the participants. One worker runs
#: every role. ``replicas``: every worker runs every role, each consumer of each role taking a
#: share of the partitions.
LAYOUTS = ("services", "replicas")
#: Every role but the participants', so a role the worker gains runs somewhere.
ORCHESTRATING_ROLES = ",".join(role for role in worker.ROLES if role != "participants")


def worker_roles(layout: str, count: int) -> list[str | None]:
    """The ``--roles`` of each of ``count`` workers under ``layout`` (None: every role)."""
    if layout == "replicas" or count == 1:
        return [None] * count
    return [ORCHESTRATING_ROLES, *["participants"] * (count - 1)]


@dataclasses.dataclass
class Options:
    db: str
    broker: str = env.TANSU
    sagas: int = 1000
    workers: int = 2
    compensate: float = 0.1
    app: str = SAGAS["full"][0]
    saga_module: str = SAGAS["full"][1]
    peer: str | None = None
    peer_sagas: int = 500
    peer_script: str | None = None
    #: Orders placed per second; None places them back to back, from ``placers`` sessions.
    rate: float | None = None
    placers: int = 8
    timeout: float = 300.0
    keep_db: bool = False
    setup_sql: tuple[str, ...] = ()
    #: How the roles are spread over the workers (:data:`LAYOUTS`).
    layout: str = "services"

    def __post_init__(self) -> None:
        if min(self.sagas, self.workers, self.peer_sagas, self.placers) < 1:
            raise errors.ConfigurationError(
                "--sagas, --workers, --peer-sagas and --placers must be >= 1"
            )
        if self.layout not in LAYOUTS:
            raise errors.ConfigurationError(
                f"--layout must be one of {', '.join(LAYOUTS)}, not {self.layout!r}"
            )
        if not 0 <= self.compensate <= 1:
            raise errors.ConfigurationError("--compensate must be within 0..1")
        if self.rate is not None and self.rate <= 0:
            raise errors.ConfigurationError("--rate must be positive")
        if self.rate is not None and self.peer is not None:
            # The peer runs flat out: a ratio to a paced run would compare nothing.
            raise errors.ConfigurationError(
                "--peer compares throughput, --rate measures latency at a load: choose one"
            )


def run(options: Options, report: Report) -> bool:
    from saga_engine import cli

    app = cli.load_app(options.app)
    module = importlib.import_module(options.saga_module)
    with (
        env.kafka_broker(options.broker) as broker,
        env.scratch_database(options.db, keep=options.keep_db) as url,
    ):
        engine = db.create_engine(url, pool_size=max(2, options.placers))
        try:
            healthy = Bench(options, report, app, module, url, engine, broker).run()
        finally:
            engine.dispose()
    if options.peer == "temporal":
        peer_rate = run_temporal(options, report)
        report.section("ratio")
        ratio = report.ratio(
            "vs_temporal", report.data["sagas_per_s"], peer_rate, "saga-engine / Temporal"
        )
        report.target(
            "vs_temporal", ratio >= TARGET_VS_TEMPORAL, f">= {TARGET_VS_TEMPORAL:g} x Temporal"
        )
    return healthy


class Bench:
    def __init__(
        self,
        options: Options,
        report: Report,
        app: Any,
        module: Any,
        url: str,
        engine: Engine,
        broker: env.Broker,
    ) -> None:
        self.o = options
        self.report = report
        self.app = app
        self.module = module
        self.url = url
        self.engine = engine
        self.broker = broker
        self.logs: list[IO[bytes]] = []

    def run(self) -> bool:
        o, report = self.o, self.report
        report.section(f"saga benchmark: {o.sagas:,} order sagas on {o.workers} worker process(es)")
        report.figure("saga", self.module.__name__, "saga module")
        report.figure("sagas", o.sagas, "sagas")
        report.figure("workers", o.workers, "worker processes (K)")
        report.figure("layout", o.layout, "roles: as services, or every role in every worker")
        placers = o.placers if o.rate is None else 1
        report.figure("placers", placers, "sessions placing orders side by side")
        report.figure("compensate_share", o.compensate, "share declined at payment")
        if o.rate is not None:
            report.figure("offered_rate", o.rate, "orders placed per second", "sagas/s")
        self.app.create_tables(self.engine)
        self.module.seed(self.engine, orders=o.sagas + 2 * WARMUP_SAGAS)
        env.run_setup_sql(self.engine, o.setup_sql, report.note)
        roles = worker_roles(o.layout, o.workers)
        with workers(self.url, self.broker.url, o.app, roles) as (procs, logs):
            self.logs = logs
            self._warm_up()
            cpu_before = [env.cpu_seconds(p.pid) for p in procs]
            broker_before, machine = self.broker.cpu_seconds(), env.MachineCpu()
            placing_before = time.process_time()  # every thread of this process: the placers
            placed = self._place(range(2 * WARMUP_SAGAS, 2 * WARMUP_SAGAS + o.sagas), rate=o.rate)
            placing = time.process_time() - placing_before
            finished = self._wait()
            machine_seconds, busy = machine.usage()
            cpu = Cpu(
                workers=sum(
                    env.cpu_seconds(p.pid) - c for p, c in zip(procs, cpu_before, strict=True)
                ),
                placing=placing,
                broker=self.broker.cpu_seconds() - broker_before,
                machine=machine_seconds,
                busy=busy,
            )
            rss = [env.peak_rss_mb(p.pid) for p in procs]
            # With the workers' logs still open.
            return self._figures(placed, finished, cpu, rss)

    def _warm_up(self) -> None:
        """Every worker joined its groups and connected, before the clock starts."""
        for round_ in range(2):
            first = round_ * WARMUP_SAGAS
            self._place(range(first, first + WARMUP_SAGAS), compensate=0.0)
            if not self._wait(timeout=120):
                raise errors.SagaEngineError("warm-up sagas did not finish in 120 s")
            time.sleep(2.0)

    def _place(
        self, numbers: range, compensate: float | None = None, rate: float | None = None
    ) -> list[str]:
        """Place the orders ``numbers``: at ``rate`` per second (open loop, one session), or back
        to back from ``placers`` sessions side by side. One session alone, waiting on each
        commit, placed the outline's orders more slowly than the workers ended them, and the
        figure was then the bench's own rate."""
        share = self.o.compensate if compensate is None else compensate
        placers = self.o.placers if rate is None else 1
        if placers == 1:
            return self._place_from(numbers, share, rate)
        with concurrent.futures.ThreadPoolExecutor(placers) as pool:
            shares = [numbers[i::placers] for i in range(placers)]
            done = pool.map(lambda part: self._place_from(part, share, None), shares)
            return [saga_id for part in done for saga_id in part]

    def _place_from(self, numbers: range, share: float, rate: float | None) -> list[str]:
        every = round(1 / share) if share > 0 else 0
        placed = []
        started = time.monotonic()
        # One connection per placing session for the whole run: a pool checkout and return per
        # order cost 0.07-0.09 ms of client CPU, which the placers would take from the workers.
        with self.engine.connect() as conn:
            for i, n in enumerate(numbers):
                if rate is not None:
                    # On a fixed schedule: an order placed late does not push the later ones back.
                    time.sleep(max(0.0, started + i / rate - time.monotonic()))
                fail_at = "payment" if every and n % every == 0 else None
                with Session(conn) as session, session.begin():
                    request = self.module.sample_order(n, fail_at)
                    placed.append(self.module.place_order(self.app, session, **request))
        return placed

    def _wait(self, timeout: float | None = None) -> bool:
        """Wait until no saga is open (the bench's sagas are the only ones in its database)."""
        deadline = time.monotonic() + (timeout or self.o.timeout)
        while time.monotonic() < deadline:
            with self.engine.connect() as conn:
                open_ = conn.scalar(
                    sa.select(sa.func.count()).select_from(s).where(s.c.ended_at.is_(None))
                )
            if not open_:
                return True
            time.sleep(0.2)
        return False

    def _figures(self, placed: list[str], finished: bool, cpu: Cpu, rss: list[float]) -> bool:
        report = self.report
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(s.c.id, s.c.state, s.c.created_at, s.c.ended_at).where(s.c.id.in_(placed))
            ).all()
            start = min(r.created_at for r in rows)
            # The messages of the placed sagas (commands and replies carry the saga's id), not of
            # the warm-up's. By time it would miss the first one: a saga's first command is
            # written a moment before the saga's own row.
            # Delivered messages are in the history where the relays archive (on_sent "auto").
            messages = sum(
                conn.scalar(
                    sa.select(sa.func.count())
                    .select_from(o.join(s, o.c.aggregate_id == s.c.id))
                    .where(s.c.created_at >= start)
                )
                or 0
                for o in (schema.outbox, schema.outbox_history)
            )
            duplicates = conn.scalar(
                sa.select(sa.func.count()).select_from(schema.inbox_duplicates)
            )
            dead = conn.scalar(sa.select(sa.func.count()).select_from(schema.dead_letters))
        ended = [r for r in rows if r.ended_at is not None]
        states: dict[str, int] = {}
        for r in rows:
            states[r.state] = states.get(r.state, 0) + 1
        report.section("results")
        end = max(r.ended_at for r in ended) if ended else start
        elapsed = max(1e-9, (end - start).total_seconds())
        report.figure("sagas_per_s", len(ended) / elapsed, "sagas per second", "sagas/s")
        latencies = [1000 * (r.ended_at - r.created_at).total_seconds() for r in ended]
        report.figure("latency_p50_ms", percentile(latencies, 0.5), "saga latency p50", "ms")
        report.figure("latency_p99_ms", percentile(latencies, 0.99), "saga latency p99", "ms")
        report.figure("elapsed_s", elapsed, "first created -> last ended", "s")
        report.figure("messages_per_saga", messages / len(placed), "outbox messages per saga")
        report.figure("completed", states.get("COMPLETED", 0), "COMPLETED")
        report.figure("compensated", states.get("COMPENSATED", 0), "COMPENSATED")
        report.figure("failed", states.get("FAILED", 0), "FAILED")
        report.figure("unfinished", len(rows) - len(ended), "not ended")
        report.figure("duplicates", duplicates or 0, "duplicate deliveries absorbed by the inbox")
        report.figure("dead_letters", dead or 0, "dead letters")
        report.figure("worker_peak_rss_mb", max(rss), "peak worker RSS", "MiB")
        self._cpu_figures(cpu, len(placed))
        violations = self.module.check_invariants(self.engine, all_terminal=finished)
        report.figure("invariant_violations", len(violations), "business invariant violations")
        for violation in violations[:5]:
            report.note(violation)
        if not finished:
            for line in unfinished_sagas(self.engine, placed):
                report.note(line)
            for i, log in enumerate(self.logs):
                report.note(f"worker {i} log, last lines:")
                for line in tail(log, 8):
                    report.note(f"  {line}")
        return finished and not violations and not states.get("FAILED")

    def _cpu_figures(self, cpu: Cpu, sagas: int) -> None:
        """Where the machine's CPU went, per saga, from the first order placed to the last saga
        ended: the workers, the placing, the broker (a tansu this run started), the rest."""
        report = self.report
        per_saga = 1000 / sagas
        report.figure("worker_cpu_ms_per_saga", cpu.workers * per_saga, "worker CPU per saga", "ms")
        report.figure(
            "placing_cpu_ms_per_saga",
            cpu.placing * per_saga,
            "the bench's own CPU placing them, per saga",
            "ms",
        )
        known = cpu.workers + cpu.placing
        if not math.isnan(cpu.broker):
            report.figure(
                "broker_cpu_ms_per_saga", cpu.broker * per_saga, "broker CPU per saga", "ms"
            )
            known += cpu.broker
        report.figure(
            "machine_cpu_ms_per_saga", cpu.machine * per_saga, "the machine's CPU per saga", "ms"
        )
        report.rest(
            "other_cpu_ms_per_saga",
            (cpu.machine - known) * per_saga,
            "  the rest (the database, if it runs here)",
            "ms",
        )
        report.figure("machine_busy", 100 * cpu.busy, "machine CPU busy", "%")


def unfinished_sagas(engine: Engine, placed: list[str], limit: int = 5) -> list[str]:
    """Where the first ``limit`` sagas that did not end stopped: each one's state, and each of its
    messages (commands and replies carry the saga's id) with its outbox status and the consumers
    whose inbox holds it, under the key each consumer records. A message sent but in no inbox was
    lost between broker and consumer. Runs once, after a run that failed."""
    lines: list[str] = []
    with engine.connect() as conn:
        stuck = conn.execute(
            sa.select(s.c.id, s.c.state, s.c.attempt, s.c.command_id, s.c.deadline, s.c.updated_at)
            .where(s.c.id.in_(placed), s.c.ended_at.is_(None))
            .order_by(s.c.created_at)
            .limit(limit)
        ).all()
        for saga in stuck:
            lines.append(
                f"saga {saga.id}: {saga.state}, attempt {saga.attempt}, awaiting "
                f"{saga.command_id}, deadline {saga.deadline}, updated {saga.updated_at}"
            )
            lines += [_message_line(conn, table, row) for table, row in _messages_of(conn, saga.id)]
    return lines


def _messages_of(conn: sa.Connection, saga_id: str) -> list[tuple[sa.Table, Any]]:
    """The outbox rows a saga caused, undelivered and delivered, each with its table: the relay's
    columns (``to_outgoing`` reads those by name) and how the row fared."""
    return [
        (table, row)
        for table in (schema.outbox, schema.outbox_history)
        for row in conn.execute(
            sa.select(*(table.c[column.name] for column in ROW_COLUMNS))
            .add_columns(table.c.status, table.c.sent_at, table.c.retry_count, table.c.last_error)
            .where(table.c.aggregate_id == saga_id)
            .order_by(table.c.id)
        )
    ]


def _message_line(conn: sa.Connection, table: sa.Table, row: Any) -> str:
    # The message as its consumers received it (or would have).
    envelope = Envelope.from_wire(to_outgoing(row).value)
    # The orchestrator records a reply's message id; a participant, a command's command id.
    keys = {by_message_id(envelope), ParticipantService.dedupe_key(envelope)}
    seen_by = conn.scalars(
        sa.select(schema.inbox.c.consumer).where(schema.inbox.c.message_id.in_(keys))
    ).all()
    return (
        f"  {table.name} {row.message_type} {row.message_id}: status {row.status}, "
        f"sent {row.sent_at}, retries {row.retry_count}, error {row.last_error}, "
        f"in the inbox of {', '.join(seen_by) or 'no consumer'}"
    )


@dataclasses.dataclass(frozen=True)
class Cpu:
    """CPU seconds spent while the bench's sagas ran, by whom."""

    workers: float
    placing: float
    #: NaN for a broker the run did not start (its CPU is then part of the rest).
    broker: float
    #: Every process on the machine together, the database's included.
    machine: float
    #: Fraction (0..1) of all cores' time that was not idle.
    busy: float


@contextmanager
def workers(
    url: str, broker_url: str, app: str, roles: list[str | None]
) -> Iterator[tuple[list[subprocess.Popen[bytes]], list[IO[bytes]]]]:
    """One ``saga-engine worker`` process for each entry of ``roles``, with those roles (None:
    every role); stopped (SIGTERM) afterwards."""
    command = [*saga_engine_command(), "worker", "--app", app, "--db", url, "--broker", broker_url]
    logs: list[IO[bytes]] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for own in roles:
            logs.append(tempfile.TemporaryFile())  # noqa: SIM115 - closed in finally
            procs.append(
                subprocess.Popen(
                    command if own is None else [*command, "--roles", own],
                    stdin=subprocess.DEVNULL,
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                )
            )
        yield procs, logs
        for proc, output in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                output.seek(0)
                tail = output.read()[-2000:].decode(errors="replace")
                raise errors.SagaEngineError(f"a worker exited with {proc.returncode}:\n{tail}")
    finally:
        for proc in procs:
            env.stop_process(proc, timeout=30)
        for log in logs:
            log.close()


def tail(log: IO[bytes], lines: int) -> list[str]:
    """The last ``lines`` lines of a worker's log so far."""
    log.flush()
    log.seek(0)
    text = log.read()[-20_000:].decode(errors="replace")
    log.seek(0, 2)
    return text.splitlines()[-lines:]


def saga_engine_command() -> list[str]:
    """The ``saga-engine`` console script of this installation (else ``python -m``)."""
    script = Path(sys.executable).parent / "saga-engine"
    return [str(script)] if script.exists() else [sys.executable, "-m", "saga_engine.cli"]


# -- the peer ------------------------------------------------------------------------------------

#: The peer's last line. Its rate is matched, not read: it is rounded (see PeerResult.per_s).
PEER_LINE = re.compile(r"temporal: (\d+) sagas \((\d+) compensated\) in ([\d.]+)s = [\d.]+ sagas/s")


def run_temporal(options: Options, report: Report) -> float:
    """The peer script on a fresh in-memory Temporal dev server; returns its sagas/s."""
    report.section(f"peer: Temporal dev server (in memory), {options.peer_sagas:,} sagas")
    script = options.peer_script
    command = (
        [sys.executable, script]
        if script
        else [sys.executable, "-m", "saga_engine.bench.temporal_peer"]
    )
    with env.temporal_dev_server() as address:
        done = subprocess.run(
            [*command, str(options.peer_sagas), address],
            capture_output=True,
            text=True,
            timeout=options.timeout,
            check=False,
        )
    peer = peer_result(done.stdout)
    if done.returncode != 0 or peer is None:
        tail = (done.stdout + done.stderr)[-2000:]
        raise errors.SagaEngineError(f"the Temporal peer failed ({done.returncode}):\n{tail}")
    report.figure("temporal_script", script or "saga_engine.bench.temporal_peer", "peer script")
    report.figure("temporal_sagas", peer.sagas, "sagas")
    report.figure("temporal_compensated", peer.compensated, "compensated")
    report.figure("temporal_elapsed_s", peer.elapsed_s, "elapsed", "s")
    return float(report.figure("temporal_sagas_per_s", peer.per_s, "sagas per second", "sagas/s"))


class PeerResult(NamedTuple):
    """What the peer's result line says."""

    sagas: int
    compensated: int
    elapsed_s: float

    @property
    def per_s(self) -> float:
        """Sagas per second. The line's own rate is rounded to 0.1 sagas/s, up to 0.2 % of the
        ratio at Temporal's 20-30 sagas/s, so the rate is the sagas over the elapsed time (printed
        to 0.01 s) instead."""
        return self.sagas / self.elapsed_s


def peer_result(stdout: str) -> PeerResult | None:
    """The peer's result line in ``stdout``, or None if there is none with a time."""
    match = PEER_LINE.search(stdout)
    if match is None:
        return None
    peer = PeerResult(int(match[1]), int(match[2]), float(match[3]))
    return peer if peer.elapsed_s > 0 else None
