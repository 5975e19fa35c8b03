"""Real processes for the crash tests: worker processes, the order workload and the figures a run
reports. The TCP proxy to cut the broker off with is :mod:`tests.support.proxy`.

Everything listens and connects on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from saga_engine import clock, db, schema
from saga_engine.machine import COMPENSATED, COMPLETED, TERMINAL
from sagas import order_fulfilment
from sagas.app import app as shop
from sagas.order_fulfilment import FailAt
from tests.support import databases

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).with_name("saga-engine")
COMMAND = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "saga_engine.cli"]
FIGURES = REPO / "bench-results" / "crash-figures.jsonl"
APP = "sagas.app:app"
SAGA = order_fulfilment.order_fulfilment.name
s = schema.saga_instances


# -- worker processes -------------------------------------------------------------------------


class WorkerProcess:
    """``saga-engine worker`` in its own process group, its output in files."""

    def __init__(self, name: str, db_url: str, broker_url: str, logs: Path) -> None:
        self.name = name
        self.log = logs / f"{name}.log"
        self.killed = False
        # SAGA_CRASH_LOG_LEVEL=info shows the consumer-group joins etc. when diagnosing a run.
        level = os.environ.get("SAGA_CRASH_LOG_LEVEL", "warning")
        args = [*COMMAND, "--log-level", level, "worker", "--app", APP, "--db", db_url]
        args += ["--broker", broker_url]
        with self.log.open("wb") as out:
            self.popen = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": _pythonpath(), "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole process group: no handler, no cleanup, no goodbye to the broker."""
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def signal(self, signum: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signum)

    def wait(self, timeout: float = 30.0) -> int:
        """The exit status; SIGKILL if the process is not gone within ``timeout``."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.popen.wait(10)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


class Fleet:
    """The worker processes of one test; whatever is left running is killed at the end."""

    def __init__(self, db_url: str, broker_url: str, logs: Path) -> None:
        self.db_url, self.broker_url, self.logs = db_url, broker_url, logs
        self.workers: list[WorkerProcess] = []
        self.kills = 0

    def spawn(self) -> WorkerProcess:
        worker = WorkerProcess(
            f"worker-{len(self.workers)}", self.db_url, self.broker_url, self.logs
        )
        self.workers.append(worker)
        return worker

    @property
    def running(self) -> list[WorkerProcess]:
        return [w for w in self.workers if not w.killed]

    def kill_one(self, rng: random.Random) -> WorkerProcess:
        victim = rng.choice(self.running)
        victim.kill()
        self.kills += 1
        return victim

    def died_by_themselves(self) -> list[str]:
        """Workers nobody killed that are not running any more: a loop died, or a crash."""
        return [
            f"{w.name} exited with status {w.popen.returncode}:\n{tail(w.output())}"
            for w in self.running
            if not w.alive
        ]

    def stop(self) -> list[int]:
        """SIGTERM the running workers at once, then wait for each (SIGKILL after 30 s)."""
        for worker in self.running:
            worker.signal(signal.SIGTERM)
        return [worker.wait() for worker in self.running]

    def kill_all(self) -> None:
        for worker in self.workers:
            if worker.alive:
                worker.kill()

    def problems_in_logs(self) -> list[str]:
        """What no worker should ever log, whatever was killed or cut: a loop or a thread that
        died, or a traceback other than those kafka-python logs about its own sockets (it does,
        now and then, when a connection closes under a receive)."""
        out = []
        for worker in self.workers:
            logger = ""  # of the last log record: a traceback belongs to it
            for line in worker.output().splitlines():
                if record := LOG_RECORD.match(line):
                    logger = record["logger"]
                if "stopped by an unexpected error" in line or line.startswith("Exception in"):
                    out.append(f"{worker.name}: {line}")
                elif line.startswith("Traceback") and not logger.startswith("kafka."):
                    out.append(f"{worker.name}: a traceback after a record of {logger!r}")
        return out


#: The start of a log line as ``saga-engine`` formats it: time, level, logger.
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ (?P<logger>[\w.]+): ")


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def fleet(db_url: str, broker_url: str, logs: Path) -> Iterator[Fleet]:
    workers = Fleet(db_url, broker_url, logs)
    try:
        yield workers
    finally:
        workers.kill_all()


# -- the shop: tables, orders, what became of them --------------------------------------------


#: Kafka consumer settings for the crash tests. A 3 s session detects a SIGKILLed worker quickly
#: (tansu holds a group join for ~2 s with it). The poll interval is 30 s, not the 3 s of
#: ``TEST_OPTIONS``: a batch slowed down by a dead database or a deadlock retry must not make a
#: live member leave its group, because tansu can then livelock the group (every member loops
#: JoinGroup -> SyncGroup "rebalance in progress" with no leader elected, and stops consuming).
CRASH_OPTIONS = "max_poll_interval_ms=30000&session_timeout_ms=3000"


def kafka_url(host_port: str) -> str:
    return f"kafka://{host_port}?{CRASH_OPTIONS}"


def seed(engine: Engine, orders: int) -> None:
    order_fulfilment.seed(engine, orders=orders)


def failure_plan(n: int, fail_rate: float, rng: random.Random) -> list[FailAt | None]:
    """Where each order fails (None: it completes): half out of stock, half card declined."""
    plan: list[FailAt | None] = [None] * n
    for i, index in enumerate(rng.sample(range(n), round(n * fail_rate))):
        plan[index] = "inventory" if i % 2 == 0 else "payment"
    return plan


@dataclass
class Orders:
    """The orders placed so far, by saga id, with where each was made to fail."""

    plan: Sequence[FailAt | None]
    placed: dict[str, FailAt | None] = field(default_factory=dict)

    def place(self, engine: Engine, first: int, count: int) -> None:
        """Orders ``first`` .. ``first + count - 1`` of the plan, in one transaction."""
        numbers = range(first, min(first + count, len(self.plan)))
        with Session(engine) as session, session.begin():
            ids = [
                order_fulfilment.place_order(
                    shop, session, **order_fulfilment.sample_order(n, self.plan[n])
                )
                for n in numbers
            ]
        self.placed.update(zip(ids, (self.plan[n] for n in numbers), strict=True))

    @property
    def injected(self) -> set[str]:
        return {saga_id for saga_id, fail_at in self.placed.items() if fail_at is not None}


def states(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(s.c.id, s.c.state).where(s.c.saga_type == SAGA)).all())


def ended(engine: Engine) -> int:
    with engine.connect() as conn:
        stmt = sa.select(sa.func.count()).select_from(s).where(s.c.state.in_(TERMINAL))
        return int(conn.scalar(stmt) or 0)


def wait_until_all_ended(
    engine: Engine, total: int, timeout: float, check: Callable[[], None] = lambda: None
) -> bool:
    """Wait until every saga has ended (True) or ``timeout`` passed (False); ``check`` runs on
    every look, to fail at once when a worker died."""
    deadline = time.monotonic() + timeout
    while ended(engine) < total:
        check()
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def why_not_ended(engine: Engine) -> str:
    """For a failure message: the sagas still running, and whether their next message is waiting
    in the outbox (delayed, not lost) and until when."""
    o = schema.outbox
    running = [i for i, state in states(engine).items() if state not in TERMINAL]
    with engine.connect() as conn:
        waiting = conn.execute(
            sa.select(sa.func.count(sa.distinct(o.c.aggregate_id)), sa.func.max(o.c.next_retry_at))
            .where(o.c.status == schema.OutboxStatus.PENDING)
            .where(o.c.aggregate_id.in_(running))
        ).one()
    due = (waiting[1] - clock.SYSTEM.now()).total_seconds() if waiting[1] else 0.0
    return (
        f"{len(running)} sagas still running (e.g. {running[:3]}); {waiting[0]} of them have "
        f"their next message PENDING in the outbox, the last due in {due:.0f} s"
    )


def count(engine: Engine, table: sa.Table, where: Any = None) -> int:
    stmt = sa.select(sa.func.count()).select_from(table)
    with engine.connect() as conn:
        return int(conn.scalar(stmt if where is None else stmt.where(where)) or 0)


def outcome_problems(engine: Engine, orders: Orders) -> list[str]:
    """Every saga ended as its plan says: injected failures COMPENSATED, all others COMPLETED;
    the business invariants hold; the outbox holds nothing unsent."""
    found = states(engine)
    problems = [f"saga {i} was placed but is missing" for i in orders.placed if i not in found]
    for saga_id, fail_at in orders.placed.items():
        expected = COMPLETED if fail_at is None else COMPENSATED
        if saga_id in found and found[saga_id] != expected:
            problems.append(f"saga {saga_id} ({fail_at or 'no failure'}): {found[saga_id]}")
    problems += order_fulfilment.check_invariants(engine, all_terminal=True)
    o = schema.outbox
    unsent = count(engine, o, o.c.status != schema.OutboxStatus.SENT)
    if unsent:
        problems.append(f"{unsent} outbox rows are not SENT")
    return problems


def effects_applied_twice(engine: Engine) -> list[str]:
    """Each command of these sagas is sent once and handled once: one command row and one reply
    row per command id. A participant that ran a redelivered command again would reply twice."""
    with engine.connect() as conn:  # delivered rows are in the history where relays archive
        rows = [
            row
            for o in (schema.outbox, schema.outbox_history)
            for row in conn.execute(sa.select(o.c.destination, o.c.headers)).all()
        ]
    written: Counter[tuple[str, str]] = Counter()
    for destination, headers in rows:
        command_id = json.loads(headers).get("command_id")
        if command_id:
            kind = "reply" if destination.endswith(".replies") else "command"
            written[(kind, command_id)] += 1
    return [
        f"{kind} of command {cid} written {n} times" for (kind, cid), n in written.items() if n > 1
    ]


def figures(engine: Engine, orders: Orders, **extra: Any) -> dict[str, Any]:
    found = states(engine)
    by_consumer = sa.select(schema.inbox_duplicates.c.consumer, sa.func.count()).group_by(
        schema.inbox_duplicates.c.consumer
    )
    with engine.connect() as conn:
        duplicates = dict(conn.execute(by_consumer).all())
    return {
        "sagas": len(orders.placed),
        "ended": sum(1 for v in found.values() if v in TERMINAL),
        "completed": sum(1 for v in found.values() if v == COMPLETED),
        "compensated": sum(1 for v in found.values() if v == COMPENSATED),
        "injected_failures": len(orders.injected),
        "duplicates_absorbed": sum(duplicates.values()),
        "duplicates_by_consumer": duplicates,
        "dead_letters": count(engine, schema.dead_letters),
        # Written, wherever the relays left them (the history, where they archive).
        "outbox_messages": sum(count(engine, o) for o in (schema.outbox, schema.outbox_history)),
        "outbox_retried": sum(
            count(engine, o, o.c.retry_count > 0) for o in (schema.outbox, schema.outbox_history)
        ),
        **extra,
    }


def report(test: str, result: dict[str, Any]) -> None:
    """Print the figures and append them to bench-results/crash-figures.jsonl."""
    line = {"test": test, "at": datetime.now(UTC).isoformat(timespec="seconds"), **result}
    print(f"\n[crash figures] {json.dumps(line, sort_keys=True)}")
    FIGURES.parent.mkdir(exist_ok=True)
    with FIGURES.open("a") as out:
        out.write(json.dumps(line, sort_keys=True) + "\n")


def admin_url() -> str:
    """The PostgreSQL server's own test database (not the one a test runs in)."""
    return databases.POSTGRES_URL


def open_engine(url: str, engines: list[object]) -> Engine:
    engine = db.create_engine(url, pool_size=2)
    engines.append(engine)
    return engine
