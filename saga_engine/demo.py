"""``saga-engine demo``: the order-fulfilment saga N times, some made to fail, on a real database.

What a run does, in order:

1. **The database.** Without ``db_url``: a fresh SQLite file in a temporary directory, deleted
   afterwards. With ``db_url``: that database is treated as the demo's own. The example's tables
   and the engine's tables in it are DROPPED and created again, so every run starts clean (use a
   dedicated database; an ``alembic_version`` row, if any, is left as it is and still matches).
2. **Orders.** Stock and accounts are seeded (``sagas.order_fulfilment.seed``), then N orders are
   placed through ``place_order``, 100 per transaction. A fraction ``fail_rate`` of them, chosen
   by a seeded random (the same every run), are made to fail: half out of stock, half card
   declined.
3. **The worker.** An in-process :class:`saga_engine.worker.Worker` (orchestrator, participants,
   relay, deadlines) runs until every saga has ended or the time allowed (it scales with N) runs
   out; sagas still running then are reported as stuck.
4. **The report.** A summary table and the business invariants
   (``sagas.order_fulfilment.check_invariants``); with ``as_json`` only one JSON object is
   printed, on the last line. The progress bar goes to stderr, and only when it is a terminal.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from saga_engine import clock, db, errors, schema
from saga_engine.app import App
from saga_engine.consumer import ConsumerConfig
from saga_engine.machine import COMPENSATED, COMPLETED, FAILED, TERMINAL
from saga_engine.outbox.relay import RelayConfig
from saga_engine.worker import Worker, WorkerOptions
from sagas import order_fulfilment
from sagas.app import build_app
from sagas.order_fulfilment import FailAt

ORDERS_PER_TRANSACTION = 100
SAGA = "order_fulfilment"


def run_demo(
    sagas: int = 100,
    fail_rate: float = 0.1,
    db_url: str | None = None,
    broker_url: str | None = None,
    as_json: bool = False,
    out: TextIO | None = None,
    *,
    timeout: float | None = None,
    seed: int = 7,
) -> dict[str, Any]:
    """Run the demo and print its report to ``out`` (default stdout); returns the report."""
    if sagas < 1 or not 0 <= fail_rate <= 1:
        raise errors.ConfigurationError("sagas must be >= 1 and fail_rate within 0..1")
    with _database(db_url) as url:
        report = _run(url, broker_url or "sql://", sagas, fail_rate, timeout, seed)
    out = out or sys.stdout
    if as_json:
        print(json.dumps(report, sort_keys=True), file=out)
    else:
        print(render(report), file=out)
    return report


@contextlib.contextmanager
def _database(db_url: str | None) -> Iterator[str]:
    if db_url is not None:
        yield db_url
        return
    with tempfile.TemporaryDirectory(prefix="saga-engine-demo-") as directory:
        yield f"sqlite:///{Path(directory) / 'demo.sqlite3'}"


def demo_app() -> App:
    """The example app, polling often: a demo wants latency, a production worker less load."""
    return build_app(
        relay=RelayConfig(poll_interval=0.05), consumer=ConsumerConfig(poll_timeout=0.2)
    )


def _run(
    url: str, broker: str, n: int, fail_rate: float, timeout: float | None, seed: int
) -> dict[str, Any]:
    app = demo_app()
    engine = db.create_engine(url)
    try:
        db.check_connection(engine)
        recreate_tables(app, engine)
        order_fulfilment.seed(engine, orders=n)
        plan = failure_plan(n, fail_rate, seed)
        began = clock.SYSTEM.now()
        place_orders(app, engine, plan)
        worker = Worker(app, WorkerOptions(db_url=url, broker_url=broker, deadline_interval=0.1))
        worker.start()
        try:
            stuck = wait_until_ended(engine, worker, n, timeout or 30 + n / 5)
        finally:
            worker.stop()
        violations = order_fulfilment.check_invariants(engine, all_terminal=stuck == 0)
        return summary(engine, began, plan, stuck, violations, url, broker)
    finally:
        engine.dispose()


def recreate_tables(app: App, engine: Engine) -> None:
    """Drop the example's and the engine's tables, then create them again: a clean start."""
    owned = [
        *app.metadata,
        *(p.metadata for p in app.participants.values() if p.metadata is not None),
    ]
    for metadata in [*owned, schema.metadata]:
        metadata.drop_all(engine)
    app.create_tables(engine)


def failure_plan(n: int, fail_rate: float, seed: int) -> list[FailAt | None]:
    """Where each order fails (None: it succeeds); the same for the same arguments."""
    plan: list[FailAt | None] = [None] * n
    chosen = random.Random(seed).sample(range(n), round(n * fail_rate))
    for i, index in enumerate(chosen):
        plan[index] = "inventory" if i % 2 == 0 else "payment"
    return plan


def place_orders(app: App, engine: Engine, plan: Sequence[FailAt | None]) -> None:
    for first in range(0, len(plan), ORDERS_PER_TRANSACTION):
        with Session(engine) as session, session.begin():
            for n in range(first, min(first + ORDERS_PER_TRANSACTION, len(plan))):
                order_fulfilment.place_order(
                    app, session, **order_fulfilment.sample_order(n, plan[n])
                )


def wait_until_ended(engine: Engine, worker: Worker, total: int, timeout: float) -> int:
    """Wait for every saga to end; returns how many have not (stuck)."""
    deadline = time.monotonic() + timeout
    bar = ProgressBar(total)
    try:
        while True:
            ended = count(engine, schema.saga_instances.c.state.in_(TERMINAL))
            bar.show(ended)
            # The worker stops itself when one of its loops dies: no point waiting then.
            if ended >= total or time.monotonic() > deadline or worker.stop_event.is_set():
                return total - ended
            time.sleep(0.1)
    finally:
        bar.close()


class ProgressBar:
    """``[#####.....] 143/200`` on stderr, redrawn in place; silent when stderr is not a TTY."""

    def __init__(self, total: int, width: int = 30, stream: TextIO | None = None) -> None:
        self.total, self.width = total, width
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()

    def show(self, done: int) -> None:
        if self.enabled:
            filled = self.width * done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {done}/{self.total}")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")


def count(engine: Engine, where: Any = None, table: sa.Table = schema.saga_instances) -> int:
    stmt = sa.select(sa.func.count()).select_from(table)
    with engine.connect() as conn:
        return int(conn.scalar(stmt if where is None else stmt.where(where)) or 0)


def summary(
    engine: Engine,
    began: datetime,
    plan: Sequence[FailAt | None],
    stuck: int,
    violations: list[str],
    url: str,
    broker: str,
) -> dict[str, Any]:
    s = schema.saga_instances
    with engine.connect() as conn:
        states: dict[str, int] = dict(
            conn.execute(sa.select(s.c.state, sa.func.count()).group_by(s.c.state)).all()
        )
        last_end = conn.scalar(sa.select(sa.func.max(s.c.ended_at)))
        stuck_ids = list(
            conn.scalars(sa.select(s.c.id).where(s.c.state.not_in(TERMINAL)).limit(10))
        )
    # Measured to the last saga's end as the database recorded it, not to when we noticed.
    ended = last_end if last_end is not None and not stuck else clock.SYSTEM.now()
    duration = max((ended - began).total_seconds(), 1e-6)
    return {
        "saga": SAGA,
        "sagas": len(plan),
        "completed": states.get(COMPLETED, 0),
        "compensated": states.get(COMPENSATED, 0),
        "failed": states.get(FAILED, 0),
        "stuck": stuck,
        "stuck_ids": stuck_ids,
        "injected": {
            "out_of_stock": plan.count("inventory"),
            "card_declined": plan.count("payment"),
        },
        "duration_s": round(duration, 3),
        "sagas_per_s": round(len(plan) / duration, 1),
        # Every message written: delivered ones are in the history where the relay archives.
        "outbox_messages": count(engine, table=schema.outbox)
        + count(engine, table=schema.outbox_history),
        "duplicates": count(engine, table=schema.inbox_duplicates),
        "dead_letters": count(engine, table=schema.dead_letters),
        "invariants_ok": not violations,
        "violations": violations,
        "db": db.redact(url),
        "broker": redact_broker(broker),
    }


def redact_broker(url: str) -> str:
    try:
        return db.redact(url)
    except ValueError:  # several host:port pairs (kafka://a:9092,b:9092) are no SQLAlchemy URL
        parts = urlsplit(url)
        if parts.password is None:
            return url
        return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")).geturl()


def render(report: dict[str, Any]) -> str:
    injected = report["injected"]
    rows = [
        ("sagas", report["sagas"]),
        ("completed", report["completed"]),
        (
            "compensated",
            f"{report['compensated']}  (injected: {injected['out_of_stock']} out of stock, "
            f"{injected['card_declined']} card declined)",
        ),
        ("failed", report["failed"]),
        ("stuck", report["stuck"]),
        ("duration", f"{report['duration_s']:.2f} s"),
        ("sagas/s", f"{report['sagas_per_s']:.1f}"),
        ("outbox messages", report["outbox_messages"]),
        ("duplicates absorbed", report["duplicates"]),
        ("dead letters", report["dead_letters"]),
        ("invariants", "all hold" if report["invariants_ok"] else "VIOLATED"),
    ]
    lines = [f"saga-engine demo: {report['saga']} on {report['db']} via {report['broker']}", ""]
    lines += [f"  {name:<20} {value}" for name, value in rows]
    lines += [f"    - {v}" for v in report["violations"][:20]]
    if report["stuck_ids"]:
        lines.append(
            f"  stuck sagas (first {len(report['stuck_ids'])}): " + ", ".join(report["stuck_ids"])
        )
    return "\n".join(lines)
