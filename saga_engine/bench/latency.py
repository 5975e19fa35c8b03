"""``saga-engine bench latency``: commit -> broker acknowledgement at a fixed offered rate.

Writer processes commit one business transaction per message (a ``bench_orders`` row plus its
outbox message) on an open-loop schedule of ``--rate`` messages per second, and note the wall time
at which each commit returned. One relay process delivers them to Kafka; the latency of a message
is its ``sent_at`` (stamped by the relay once the broker acknowledged the batch; the relay archives
or marks as the engine does by default) minus its commit time. It runs twice: with NOTIFY wake-ups
(PostgreSQL), and polling only, every ``--poll-interval``. Each mode also says where the machine's
CPU went per message: the writers, the relay, the broker (one this run started), and the rest
(the database, if it runs here).

Before that, the write overhead: the p50 of a business transaction that inserts one row, with and
without ``OutboxWriter.add`` of one message (arms interleaved, no relay running).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine

from saga_engine import errors, schema
from saga_engine.bench import env, workload
from saga_engine.bench.procs import Phase
from saga_engine.bench.report import Report, percentile
from saga_engine.outbox.writer import OutboxWriter

t = schema.outbox
NOTIFY_P50_MS, NOTIFY_P99_MS = 5.0, 25.0
POLLING_SLACK_MS = 50.0
OVERHEAD_TARGET_MS = 0.3
#: The share of ``--rate`` the writers must have achieved in both modes: latencies taken while the
#: writers fell behind were taken at a lighter load than the one the run claims.
RATE_KEPT = 0.99


@dataclasses.dataclass
class Options:
    db: str
    broker: str = env.TANSU
    rate: float = 1000.0
    seconds: float = 10.0
    writers: int = 2
    threads: int = 4
    poll_interval: float = 0.5
    overhead_samples: int = 2000
    payload_bytes: int = 200
    partitions: int = 8
    keep_db: bool = False
    #: Statements run in the scratch database before measuring (e.g. to try an index).
    setup_sql: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.seconds <= 0 or self.poll_interval <= 0:
            raise errors.ConfigurationError("--rate, --seconds, --poll-interval must be positive")
        if self.writers < 1 or self.overhead_samples < 10:
            raise errors.ConfigurationError("--writers >= 1 and --overhead-samples >= 10")


def run(options: Options, report: Report) -> bool:
    with env.world(options.db, options.broker, keep_db=options.keep_db) as (url, engine, broker):
        return Bench(options, report, url, engine, broker).run()


class Bench:
    def __init__(
        self, options: Options, report: Report, url: str, engine: Engine, broker: env.Broker
    ) -> None:
        self.o = options
        self.report = report
        self.url = url
        self.engine = engine
        self.broker = broker
        self.topic = f"bench.latency.{uuid.uuid4().hex[:8]}"

    def run(self) -> bool:
        o, report = self.o, self.report
        workload.metadata.create_all(self.engine)
        env.run_setup_sql(self.engine, o.setup_sql, report.note)
        self._create_topic()
        report.section(
            f"latency benchmark: {o.rate:,.0f} msg/s offered for {o.seconds:g} s per mode"
        )
        report.figure("rate", o.rate, "offered rate", "msg/s")
        report.figure("writers", o.writers, "writer processes")
        report.figure("writer_threads", o.threads, "writer threads per process")
        report.figure("poll_interval_ms", 1000 * o.poll_interval, "relay poll interval", "ms")
        self._overhead()
        notify_ok = self._mode("notify", notify=self.engine.dialect.name == "postgresql")
        polling_ok = self._mode("polling", notify=False)
        d = report.data
        report.section("targets")
        report.target(
            "notify_p50", d["notify_p50_ms"] <= NOTIFY_P50_MS, f"NOTIFY p50 <= {NOTIFY_P50_MS:g} ms"
        )
        report.target(
            "notify_p99", d["notify_p99_ms"] <= NOTIFY_P99_MS, f"NOTIFY p99 <= {NOTIFY_P99_MS:g} ms"
        )
        bound = 1000 * o.poll_interval + POLLING_SLACK_MS
        report.target("polling_p99", d["polling_p99_ms"] <= bound, f"polling p99 <= {bound:g} ms")
        report.target(
            "write_overhead",
            d["overhead_added_p50_ms"] <= OVERHEAD_TARGET_MS,
            f"outbox write adds <= {OVERHEAD_TARGET_MS:g} ms",
        )
        achieved = min(d["notify_achieved_rate"], d["polling_achieved_rate"])
        report.target(
            "offered_rate",
            achieved >= RATE_KEPT * o.rate,
            f"writers kept >= {RATE_KEPT:.0%} of {o.rate:,.0f} msg/s",
        )
        return notify_ok and polling_ok

    def _create_topic(self) -> None:
        from saga_engine.transport.kafka import KafkaTransport

        kafka = KafkaTransport([self.broker.bootstrap], partitions=self.o.partitions)
        try:
            kafka.ensure_channels([self.topic])
        finally:
            kafka.close()

    # -- the write overhead ---------------------------------------------------------------------

    def _overhead(self) -> None:
        report, samples = self.report, self.o.overhead_samples
        report.section("write overhead: one-row business transaction, with and without the outbox")
        writer = OutboxWriter()
        plain: list[float] = []
        with_outbox: list[float] = []
        add_only: list[float] = []
        warmup = max(50, samples // 10)
        for i in range(warmup + samples):
            for outbox in (i % 2 == 0, i % 2 == 1):  # alternate which arm goes first
                key = workload.order_key(i)
                began = time.perf_counter()
                with self.engine.begin() as conn:
                    workload.insert_order(conn, key)
                    if outbox:
                        added = time.perf_counter()
                        writer.add(conn, workload.envelope(self.topic, key, self.o.payload_bytes))
                        added = time.perf_counter() - added
                elapsed = time.perf_counter() - began
                if i >= warmup:
                    (with_outbox if outbox else plain).append(elapsed)
                    if outbox:
                        add_only.append(added)
        p50_plain = 1000 * percentile(plain, 0.5)
        p50_outbox = 1000 * percentile(with_outbox, 0.5)
        report.figure("overhead_samples", samples, "transactions per arm")
        report.figure("overhead_plain_p50_ms", p50_plain, "insert one row, p50", "ms")
        report.figure(
            "overhead_outbox_p50_ms", p50_outbox, "insert one row + OutboxWriter.add, p50", "ms"
        )
        report.figure(
            "overhead_added_p50_ms",
            p50_outbox - p50_plain,
            "added by the outbox (p50 difference)",
            "ms",
        )
        report.figure(
            "overhead_add_call_p50_ms",
            1000 * percentile(add_only, 0.5),
            "the add() call alone, p50 (envelope + insert)",
            "ms",
        )
        report.figure(
            "overhead_plain_p99_ms", 1000 * percentile(plain, 0.99), "insert one row, p99", "ms"
        )
        report.figure(
            "overhead_outbox_p99_ms",
            1000 * percentile(with_outbox, 0.99),
            "with the outbox, p99",
            "ms",
        )
        env.empty_outbox(self.engine)  # not for delivery: the modes start from an empty outbox

    # -- one delivery mode ----------------------------------------------------------------------

    def _mode(self, key: str, *, notify: bool) -> bool:
        o, report = self.o, self.report
        how = "NOTIFY wake-ups" if notify else f"polling every {o.poll_interval:g} s"
        report.section(f"{key}: commit -> broker acknowledgement, {how}")
        relay = Phase(
            "relay",
            [
                {
                    "db": self.url,
                    "broker": self.broker.url,
                    "batch_size": 500,
                    "poll_interval": o.poll_interval,
                    "warmup_topic": self.topic,
                    "notify": notify,
                }
            ],
        )
        per_writer = o.rate / o.writers
        writers = Phase(
            "writer",
            [
                {
                    "db": self.url,
                    "rate": per_writer,
                    "seconds": o.seconds,
                    "topic": f"{self.topic}",
                    "payload_bytes": o.payload_bytes,
                    "offset": i / o.writers,
                    "threads": o.threads,
                    "key_prefix": f"{key}-{i}",
                }
                for i in range(o.writers)
            ],
        )
        try:
            relay.start()
            writers.start()
            relay.go()
            cpu = env.MachineCpu()
            broker_before = self.broker.cpu_seconds()
            writers.go()
            expected = o.writers * o.threads * (int(per_writer * o.seconds) // o.threads)
            writers.wait_progress(expected, 3 * o.seconds + 60)
            written = writers.finish()
            commits = [c for result in written for c in result["commits"]]
            relay.wait_progress(len(commits), 60)
            machine, busy = cpu.usage()
            broker = self.broker.cpu_seconds() - broker_before
            (relayed,) = relay.finish()
        finally:
            relay.kill()
            writers.kill()
        self._relay_cost(key, relayed)
        spent = Spent(sum(r["cpu_s"] for r in written), relayed["cpu_s"], broker, machine)
        self._cpu_split(key, spent, len(commits))
        return self._latencies(key, commits, written, busy)

    def _relay_cost(self, key: str, relayed: dict[str, Any]) -> None:
        # What a wake-up costs: at a low rate nearly every commit starts a pass of its own.
        published, passes = relayed["published"], len(relayed["passes"])
        report = self.report
        report.figure(f"{key}_relay_passes", passes, "relay passes that published")
        report.figure(
            f"{key}_messages_per_pass", published / passes if passes else 0.0, "messages per pass"
        )
        report.figure(
            f"{key}_relay_cpu_ms_per_message",
            1000 * relayed["cpu_s"] / published if published else 0.0,
            "relay process CPU per message",
            "ms",
        )

    def _cpu_split(self, key: str, spent: Spent, messages: int) -> None:
        """Where the machine's CPU went while the mode ran, per message: the latency of a pass
        follows how busy the machine is, and the writers (the business application) and the
        database share it with the relay."""
        report, per_message = self.report, 1000 / max(messages, 1)
        report.figure(
            f"{key}_writer_cpu_ms_per_message",
            spent.writers * per_message,
            "writer processes' CPU per message",
            "ms",
        )
        known = spent.writers + spent.relay
        if not math.isnan(spent.broker):
            report.figure(
                f"{key}_broker_cpu_ms_per_message",
                spent.broker * per_message,
                "broker CPU per message",
                "ms",
            )
            known += spent.broker
        report.figure(
            f"{key}_machine_cpu_ms_per_message",
            spent.machine * per_message,
            "the machine's CPU per message",
            "ms",
        )
        report.rest(
            f"{key}_other_cpu_ms_per_message",
            (spent.machine - known) * per_message,
            "  the rest (the database, if it runs here)",
            "ms",
        )

    def _latencies(
        self, key: str, commits: list[Any], written: list[dict[str, Any]], busy: float
    ) -> bool:
        report = self.report
        sent: dict[str, datetime] = {}
        with self.engine.connect() as conn:
            for table in (t, schema.outbox_history):  # where the relay left each delivered row
                sent |= dict(
                    conn.execute(
                        sa.select(table.c.message_id, table.c.sent_at).where(
                            table.c.status == schema.OutboxStatus.SENT
                        )
                    ).all()
                )
        latencies = [
            1000 * (sent[mid] - _naive_utc(at)).total_seconds()
            for mid, at in commits
            if mid in sent
        ]
        missing = sum(1 for mid, _ in commits if mid not in sent)
        span = max(at for _, at in commits) - min(at for _, at in commits)
        report.figure(f"{key}_messages", len(commits), "messages committed")
        report.figure(
            f"{key}_achieved_rate", len(commits) / max(span, 1e-9), "achieved rate", "msg/s"
        )
        report.figure(
            f"{key}_writers_behind_s",
            max(r["behind_s"] for r in written),
            "writers behind schedule at the end",
            "s",
        )
        for q, name in ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"), (1.0, "max")):
            report.figure(
                f"{key}_{name}_ms", percentile(latencies, q), f"commit -> ack {name}", "ms"
            )
        report.figure(f"{key}_not_sent", missing, "committed but not SENT")
        report.figure(f"{key}_machine_busy", 100 * busy, "machine CPU busy", "%")
        return missing == 0


@dataclasses.dataclass(frozen=True)
class Spent:
    """CPU seconds spent while one mode ran, by whom."""

    writers: float
    relay: float
    #: NaN for a broker the run did not start (its CPU is then part of the rest).
    broker: float
    #: Every process on the machine together, the database's included.
    machine: float


def _naive_utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC).replace(tzinfo=None)
