"""``saga-engine bench memory``: the RSS of a worker that holds N in-flight sagas.

One ``saga-engine worker`` process runs the orchestrator, relay and deadline roles, and no
participant: the bench starts N order sagas, the worker relays their first commands to Kafka, and
every saga then waits for a reply that never comes. The worker's RSS is sampled while idle, while
relaying, and for ``--settle`` seconds after the last command was sent; the figure is the peak
(VmHWM). Saga state lives in the database, not in the worker, so RSS should not grow with N.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import tempfile
import time

import sqlalchemy as sa
from sqlalchemy.orm import Session

from saga_engine import db, errors, schema
from saga_engine.bench import env
from saga_engine.bench.report import Report
from saga_engine.bench.saga import saga_engine_command, tail

TARGET_MB = 200.0
ROLES = "orchestrator,relay,deadlines"


@dataclasses.dataclass
class Options:
    db: str
    broker: str = env.TANSU
    sagas: int = 10_000
    app: str = "sagas.app:app"
    saga_module: str = "sagas.order_fulfilment"
    settle: float = 5.0
    per_transaction: int = 100
    timeout: float = 300.0
    keep_db: bool = False

    def __post_init__(self) -> None:
        if self.sagas < 1 or self.settle < 0:
            raise errors.ConfigurationError("--sagas must be >= 1 and --settle >= 0")


def run(options: Options, report: Report) -> bool:
    import subprocess

    from saga_engine import cli

    app = cli.load_app(options.app)
    module = importlib.import_module(options.saga_module)
    report.section(f"memory benchmark: one worker ({ROLES}) holding {options.sagas:,} sagas")
    report.figure("sagas", options.sagas, "in-flight sagas started")
    with (
        env.kafka_broker(options.broker) as broker,
        env.scratch_database(options.db, keep=options.keep_db) as url,
    ):
        engine = db.create_engine(url, pool_size=2)
        app.create_tables(engine)
        module.seed(engine, orders=options.sagas)
        command = [*saga_engine_command(), "worker", "--app", options.app, "--db", url]
        command += ["--broker", broker.url, "--roles", ROLES]
        log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in finally
        worker = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            samples = Samples(worker.pid)
            samples.during(5.0)  # started, connected, consumer group joined: idle
            idle = samples.latest()
            idle_cpu = env.cpu_seconds(worker.pid)
            samples.during(5.0)
            idle_cpu = (env.cpu_seconds(worker.pid) - idle_cpu) / 5.0
            started = time.monotonic()
            for first in range(0, options.sagas, options.per_transaction):
                with Session(engine) as session, session.begin():
                    for n in range(first, min(options.sagas, first + options.per_transaction)):
                        module.place_order(app, session, **module.sample_order(n))
                samples.take()
            place_s = time.monotonic() - started
            relayed = _wait_relayed(engine, samples, options.timeout)
            samples.during(options.settle)
            with engine.connect() as conn:
                in_flight = conn.scalar(
                    sa.select(sa.func.count())
                    .select_from(schema.saga_instances)
                    .where(schema.saga_instances.c.ended_at.is_(None))
                )
            peak = env.peak_rss_mb(worker.pid)
            alive = worker.poll() is None
            if not alive:
                for line in tail(log, 10):
                    report.note(f"worker: {line}")
        finally:
            env.stop_process(worker, timeout=30)
            engine.dispose()
            log.close()
    report.figure("place_s", place_s, "time to start them", "s")
    report.figure("in_flight", in_flight or 0, "sagas still waiting (in flight)")
    report.figure("relayed", relayed, "first commands relayed")
    report.figure("idle_rss_mb", idle, "worker RSS idle, before the sagas", "MiB")
    report.figure("idle_cpu_pct", 100 * idle_cpu, "worker CPU while idle (5 s)", "% of a core")
    report.figure("final_rss_mb", samples.latest(), "worker RSS holding them", "MiB")
    report.figure("peak_rss_mb", peak, "worker peak RSS (VmHWM)", "MiB")
    report.figure("rss_samples", len(samples.values), "RSS samples")
    report.target("memory", peak < TARGET_MB, f"peak RSS < {TARGET_MB:g} MiB")
    return alive and relayed and in_flight == options.sagas


class Samples:
    """RSS samples of one process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.values: list[float] = []

    def take(self) -> None:
        value = env.rss_mb(self.pid)
        if not math.isnan(value):
            self.values.append(value)

    def during(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.take()
            time.sleep(0.25)

    def latest(self) -> float:
        return self.values[-1] if self.values else math.nan


def _wait_relayed(engine: sa.Engine, samples: Samples, timeout: float) -> bool:
    """Wait until the outbox has nothing PENDING (every first command reached the broker)."""
    t = schema.outbox
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with engine.connect() as conn:
            pending = conn.scalar(
                sa.select(sa.func.count())
                .select_from(t)
                .where(t.c.status == schema.OutboxStatus.PENDING)
            )
        samples.take()
        if not pending:
            return True
        time.sleep(0.25)
    return False
