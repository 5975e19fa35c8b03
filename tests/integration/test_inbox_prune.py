"""Pruning the inbox: entries and counted duplicates older than the retention go, in batches."""

from __future__ import annotations

import time
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from saga_engine import clock, db, errors, ids, inbox, schema
from saga_engine.inbox import Inbox, PruneResult

NOW = datetime(2030, 6, 1, 12, 0, 0)
OLD = NOW - inbox.INBOX_RETENTION - timedelta(minutes=1)
RECENT = NOW - inbox.INBOX_RETENTION + timedelta(minutes=5)


class ClockDouble:
    def __init__(self, now: datetime) -> None:
        self.current = now

    def now(self) -> datetime:
        return self.current


def entries(n: int, at: datetime) -> list[dict[str, Any]]:
    return [
        {"consumer": f"consumer-{i % 2}", "message_id": ids.new_id(), "received_at": at}
        for i in range(n)
    ]


def duplicates(n: int, at: datetime) -> list[dict[str, Any]]:
    return [{"consumer": "consumer-0", "message_id": ids.new_id(), "seen_at": at} for _ in range(n)]


def fill(engine: sa.Engine) -> dict[str, list[dict[str, Any]]]:
    groups = {
        "old": entries(2500, OLD),
        "recent": entries(100, RECENT),
        "old_duplicates": duplicates(1200, OLD),
        "recent_duplicates": duplicates(30, RECENT),
    }
    with engine.begin() as conn:
        conn.execute(schema.inbox.insert(), groups["old"] + groups["recent"])
        conn.execute(
            schema.inbox_duplicates.insert(),
            groups["old_duplicates"] + groups["recent_duplicates"],
        )
    return groups


def remaining(engine: sa.Engine, table: sa.Table) -> set[str]:
    with engine.connect() as conn:
        return set(conn.scalars(sa.select(table.c.message_id)))


def ids_of(rows: list[dict[str, Any]]) -> set[str]:
    return {row["message_id"] for row in rows}


@pytest.fixture
def engine(db_url: str) -> Any:
    engine = db.create_engine(db_url)
    yield engine
    engine.dispose()


def test_prune_deletes_only_entries_older_than_the_retention(engine: sa.Engine) -> None:
    groups = fill(engine)

    result = inbox.prune(engine, batch_size=1000, clock=ClockDouble(NOW))

    assert result == PruneResult(inbox=2500, duplicates=1200, batches=3)
    assert remaining(engine, schema.inbox) == ids_of(groups["recent"])
    assert remaining(engine, schema.inbox_duplicates) == ids_of(groups["recent_duplicates"])
    assert inbox.prune(engine, clock=ClockDouble(NOW)) == PruneResult(0, 0, 0)


def test_a_pruned_message_counts_as_new_and_a_kept_one_as_a_duplicate(engine: sa.Engine) -> None:
    groups = fill(engine)
    inbox.prune(engine, clock=ClockDouble(NOW))
    old, recent = groups["old"][0], groups["recent"][0]
    with engine.begin() as conn:
        recorder = Inbox(clock=ClockDouble(NOW))
        assert recorder.first_time(conn, old["consumer"], old["message_id"])
        assert not recorder.first_time(conn, recent["consumer"], recent["message_id"])


@pytest.mark.sqlite
def test_prune_stops_after_max_batches_and_refuses_bad_settings(sqlite_url: str) -> None:
    engine = db.create_engine(sqlite_url)
    fill(engine)
    first = inbox.prune(engine, batch_size=1000, max_batches=1, clock=ClockDouble(NOW))
    assert first == PruneResult(inbox=1000, duplicates=1000, batches=1)
    rest = inbox.prune(engine, batch_size=1000, clock=ClockDouble(NOW))
    assert rest == PruneResult(inbox=1500, duplicates=200, batches=2)
    with pytest.raises(ValueError, match="batch_size"):
        inbox.prune(engine, batch_size=0)
    with pytest.raises(ValueError, match="retention"):
        inbox.prune(engine, retention=timedelta(0))
    engine.dispose()


@pytest.mark.sqlite
@pytest.mark.parametrize("retention", [inbox.INBOX_RETENTION, None], ids=["default", "keep"])
def test_the_workers_cleanup_role_prunes_the_inbox_unless_told_to_keep_it(
    sqlite_url: str, retention: timedelta | None
) -> None:
    from saga_engine.app import App
    from saga_engine.worker import Worker, WorkerOptions

    now = clock.SYSTEM.now()
    rows = entries(3, now - timedelta(days=31)) + entries(2, now - timedelta(days=1))
    options = WorkerOptions(
        db_url=sqlite_url, roles=["cleanup"], cleanup_interval=0.05, inbox_retention=retention
    )
    worker = Worker(App("pruning", sagas=[]), options)
    with worker.main_engine.begin() as conn:
        conn.execute(schema.inbox.insert(), rows)
    worker.start()
    try:
        expected = ids_of(rows[3:]) if retention else ids_of(rows)
        deadline = time.monotonic() + 5
        while remaining(worker.main_engine, schema.inbox) != expected:
            assert time.monotonic() < deadline, "the cleanup role did not prune in 5 s"
            time.sleep(0.05)
        time.sleep(0.2)  # a few more cleanup passes: still nothing else is deleted
        assert remaining(worker.main_engine, schema.inbox) == expected
    finally:
        worker.stop()
    with pytest.raises(errors.ConfigurationError, match="inbox_retention"):
        WorkerOptions(db_url=sqlite_url, inbox_retention=timedelta(0))
