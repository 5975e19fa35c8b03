"""Pruning ended sagas and dead letters: by function, by the worker's cleanup role, by the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from saga_engine import clock, db, deadletter, errors, ids, schema, store
from saga_engine.outbox import cleanup

NOW = datetime(2030, 6, 1, 12, 0, 0)
MONTH = timedelta(days=30)
CLI = str(Path(sys.executable).with_name("saga-engine"))
s, d = schema.saga_instances, schema.dead_letters


class ClockDouble:
    def __init__(self, now: datetime) -> None:
        self.current = now

    def now(self) -> datetime:
        return self.current


def saga(started: datetime, ended: datetime | None, state: str = "COMPLETED") -> dict[str, Any]:
    return {
        "id": ids.new_id(),
        "saga_type": "order_fulfilment",
        "definition_version": 1,
        "state": state if ended is not None else "reserve_stock.AWAITING",
        "data": "{}",
        "version": 3,
        "attempt": 0,
        "completed_steps": "[]",
        "created_at": started,
        "updated_at": ended or started,
        "ended_at": ended,
    }


def dead_letter(at: datetime) -> dict[str, Any]:
    return {
        "consumer": "orders",
        "channel": "orders.replies",
        "message_id": ids.new_id(),
        "message_type": "StockReserved",
        "reason": "unknown saga id",
        "raw": b"{}",
        "created_at": at,
    }


def fill_sagas(engine: sa.Engine, now: datetime) -> dict[str, list[dict[str, Any]]]:
    """Sagas a retention of 30 days must delete, and two kinds it must keep."""
    long_ago, lately = now - timedelta(days=40), now - timedelta(days=29)
    groups = {
        "ended_long_ago": [saga(long_ago, long_ago + timedelta(hours=1)) for _ in range(1200)]
        + [saga(long_ago, long_ago, "COMPENSATED") for _ in range(100)]
        + [saga(long_ago, long_ago, "FAILED") for _ in range(5)],
        "ended_lately": [saga(long_ago, lately) for _ in range(50)],
        "running_for_long": [saga(long_ago, None) for _ in range(20)],
    }
    with engine.begin() as conn:
        for rows in groups.values():
            conn.execute(s.insert(), rows)
    return groups


def fill_dead_letters(engine: sa.Engine, now: datetime, days: tuple[int, ...]) -> None:
    with engine.begin() as conn:
        conn.execute(d.insert(), [dead_letter(now - timedelta(days=n)) for n in days])


def saga_ids(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.scalars(sa.select(s.c.id)))


def dead_letter_ages(engine: sa.Engine, now: datetime) -> list[int]:
    with engine.connect() as conn:
        return sorted((now - at).days for at in conn.scalars(sa.select(d.c.created_at)))


def inbox_ids(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.scalars(sa.select(schema.inbox.c.message_id)))


def ids_of(*groups: list[dict[str, Any]]) -> set[str]:
    return {row["id"] for rows in groups for row in rows}


@pytest.fixture
def engine(db_url: str) -> Any:
    engine = db.create_engine(db_url)
    yield engine
    engine.dispose()


def test_prune_ended_deletes_only_sagas_that_ended_before_the_retention(engine: sa.Engine) -> None:
    groups = fill_sagas(engine, NOW)

    deleted = store.prune_ended(engine, retention=MONTH, batch_size=500, clock=ClockDouble(NOW))

    assert deleted == 1305
    assert saga_ids(engine) == ids_of(groups["ended_lately"], groups["running_for_long"])
    assert store.prune_ended(engine, retention=MONTH, clock=ClockDouble(NOW)) == 0


def test_prune_of_dead_letters_deletes_only_those_older_than_the_retention(
    engine: sa.Engine,
) -> None:
    fill_dead_letters(engine, NOW, (1, 6, 8, 30, 400))

    deleted = deadletter.prune(engine, retention=timedelta(days=7), clock=ClockDouble(NOW))

    assert deleted == 3
    assert dead_letter_ages(engine, NOW) == [1, 6]


@pytest.mark.sqlite
def test_pruning_stops_after_max_batches_and_refuses_bad_settings(sqlite_url: str) -> None:
    engine = db.create_engine(sqlite_url)
    fill_sagas(engine, NOW)
    once = {"retention": MONTH, "batch_size": 1000, "clock": ClockDouble(NOW)}
    assert store.prune_ended(engine, max_batches=1, **once) == 1000
    assert store.prune_ended(engine, **once) == 305
    with pytest.raises(ValueError, match="batch_size"):
        store.prune_ended(engine, retention=MONTH, batch_size=0)
    for prune in (store.prune_ended, deadletter.prune, cleanup.prune_history):
        with pytest.raises(ValueError, match="retention"):
            prune(engine, retention=timedelta(0))
    for name in ("saga_retention", "dead_letter_retention", "history_retention"):
        with pytest.raises(errors.ConfigurationError, match=name):
            from saga_engine.worker import WorkerOptions

            WorkerOptions(db_url=sqlite_url, **{name: timedelta(0)})
    engine.dispose()


@pytest.mark.sqlite
@pytest.mark.parametrize("told", [False, True], ids=["defaults", "retentions"])
def test_the_workers_cleanup_role_prunes_ended_sagas_and_dead_letters_only_when_told(
    sqlite_url: str, told: bool
) -> None:
    from saga_engine.worker import Worker, WorkerOptions
    from sagas.app import app

    now = clock.SYSTEM.now()
    options = WorkerOptions(
        db_url=sqlite_url,
        roles=["cleanup"],
        cleanup_interval=0.05,
        saga_retention=MONTH if told else None,
        dead_letter_retention=timedelta(days=7) if told else None,
        history_retention=MONTH if told else None,
    )
    worker = Worker(app, options)
    groups = fill_sagas(worker.main_engine, now)
    fill_dead_letters(worker.main_engine, now, (1, 8, 90))
    inbox_entry = {"consumer": "c", "message_id": "m-old", "received_at": now - 2 * MONTH}
    with worker.main_engine.begin() as conn:
        conn.execute(schema.inbox.insert(), inbox_entry)
        conn.execute(
            schema.outbox_history.insert(), [archived(1, now - 2 * MONTH), archived(2, now)]
        )
    kept = ["ended_lately", "running_for_long"] if told else list(groups)
    worker.start()
    try:
        deadline = time.monotonic() + 5
        while inbox_ids(worker.main_engine):  # the inbox is pruned by default: a pass was made
            assert time.monotonic() < deadline, "the cleanup role did not run in 5 s"
            time.sleep(0.05)
        time.sleep(0.2)  # a few more passes
        assert saga_ids(worker.main_engine) == ids_of(*(groups[name] for name in kept))
        assert dead_letter_ages(worker.main_engine, now) == ([1] if told else [1, 8, 90])
        with worker.main_engine.connect() as conn:
            history = list(conn.scalars(sa.select(schema.outbox_history.c.id)))
        assert history == ([2] if told else [1, 2])
    finally:
        worker.stop()


def archived(row_id: int, at: datetime) -> dict[str, object]:
    """A row of ``outbox_history`` archived ``at``."""
    return {
        "id": row_id,
        "message_id": f"m-{row_id}",
        "message_type": "OrderCreated",
        "destination": "orders",
        "partition_key": f"o-{row_id}",
        "headers": "{}",
        "payload": "{}",
        "status": schema.OutboxStatus.SENT,
        "next_retry_at": at,
        "created_at": at,
        "updated_at": at,
        "sent_at": at,
        "archived_at": at,
    }


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "cleanup", *args], capture_output=True, text=True, timeout=60)


def test_the_cleanup_command_prunes_ended_sagas_and_if_told_dead_letters(
    db_url: str, engine: sa.Engine
) -> None:
    now = clock.SYSTEM.now()  # the CLI uses the wall clock
    groups = fill_sagas(engine, now)
    fill_dead_letters(engine, now, (1, 8, 90))

    kept = run_cli("--db", db_url)  # both are kept unless a retention is given
    assert kept.returncode == 0, kept.stderr
    assert {"sagas", "dead_letters"}.isdisjoint(json.loads(kept.stdout))
    assert len(saga_ids(engine)) == 1375 and dead_letter_ages(engine, now) == [1, 8, 90]

    done = run_cli(
        "--db", db_url, "--saga-retention-days", "30", "--dead-letter-retention-days", "7"
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["sagas"], report["dead_letters"]) == (1305, 2)
    assert saga_ids(engine) == ids_of(groups["ended_lately"], groups["running_for_long"])
    assert dead_letter_ages(engine, now) == [1]

    shorter = run_cli("--db", db_url, "--saga-retention-days", "20", "--batch-size", "7")
    assert shorter.returncode == 0, shorter.stderr
    assert json.loads(shorter.stdout)["sagas"] == 50  # ended 29 days ago
    assert saga_ids(engine) == ids_of(groups["running_for_long"])
    for option in ("--saga-retention-days", "--dead-letter-retention-days"):
        refused = run_cli("--db", db_url, option, "0")
        assert refused.returncode == 2, refused.stderr
        assert f"{option} must be positive" in refused.stderr


@pytest.mark.sqlite
def test_the_cleanup_command_leaves_sagas_alone_in_a_database_without_them(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'participant.sqlite3'}"
    engine = db.create_engine(url)
    tables = [schema.outbox, schema.outbox_history, schema.inbox, schema.inbox_duplicates]
    tables.append(schema.dead_letters)
    schema.metadata.create_all(engine, tables=tables)
    engine.dispose()

    done = run_cli("--db", url, "--saga-retention-days", "30", "--dead-letter-retention-days", "7")

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert "sagas" not in report and report["dead_letters"] == report["history"] == 0
