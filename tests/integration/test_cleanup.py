"""Batched cleanup (and archiving) of delivered outbox rows, as a function and through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from saga_engine import clock, db, ids, schema
from saga_engine.outbox.cleanup import CleanupResult, cleanup, prune_history

t = schema.outbox
h = schema.outbox_history
SENT, PENDING, FAILED = (
    schema.OutboxStatus.SENT,
    schema.OutboxStatus.PENDING,
    schema.OutboxStatus.FAILED,
)
CLI = str(Path(sys.executable).with_name("saga-engine"))


class ClockDouble:
    def __init__(self, now: datetime) -> None:
        self.current = now

    def now(self) -> datetime:
        return self.current


def row(status: int, age: timedelta, now: datetime, n: int) -> dict[str, Any]:
    at = now - age
    return {
        "message_id": ids.new_id(),
        "aggregate_type": "Order",
        "aggregate_id": f"o-{n}",
        "message_type": "OrderCreated",
        "destination": "orders.events",
        "partition_key": f"o-{n}",
        "headers": "{}",
        "payload": json.dumps({"order_id": f"o-{n}", "n": n}),
        "status": status,
        "retry_count": 0,
        "next_retry_at": at,
        "created_at": at,
        "updated_at": at,
        "sent_at": at if status == SENT else None,
    }


def fill(engine: sa.Engine, now: datetime) -> dict[str, list[dict[str, Any]]]:
    """2,500 old SENT rows, plus rows cleanup must keep: recent SENT, old PENDING and FAILED."""
    old, week = timedelta(days=8), timedelta(days=7)
    groups = {
        "old_sent": [row(SENT, old, now, n) for n in range(2500)],
        "recent_sent": [row(SENT, week - timedelta(minutes=5), now, n) for n in range(100)],
        "old_pending": [row(PENDING, old, now, n) for n in range(50)],
        "old_failed": [row(FAILED, old, now, n) for n in range(20)],
    }
    with engine.begin() as conn:
        for rows in groups.values():
            conn.execute(t.insert(), rows)
    return groups


def message_ids(engine: sa.Engine, table: sa.Table) -> set[str]:
    with engine.connect() as conn:
        return set(conn.scalars(sa.select(table.c.message_id)))


def kept(groups: dict[str, list[dict[str, Any]]]) -> set[str]:
    return {r["message_id"] for name, rows in groups.items() if name != "old_sent" for r in rows}


def setup(url: str, engines: list[object]) -> sa.Engine:
    engine = db.create_engine(url)
    engines.append(engine)
    return engine


@pytest.mark.parametrize("archive", [False, True], ids=["delete", "archive"])
def test_cleanup_removes_only_old_sent_rows_in_batches(
    db_url: str, engines: list[object], archive: bool
) -> None:
    engine = setup(db_url, engines)
    now = datetime(2030, 6, 1, 12, 0, 0)
    groups = fill(engine, now)

    result = cleanup(engine, batch_size=1000, archive=archive, clock=ClockDouble(now))

    assert result == CleanupResult(deleted=2500, archived=2500 if archive else 0, batches=3)
    assert message_ids(engine, t) == kept(groups)
    if archive:
        with engine.connect() as conn:
            history = {r.message_id: r for r in conn.execute(sa.select(h))}
        assert set(history) == {r["message_id"] for r in groups["old_sent"]}
        sample = groups["old_sent"][1234]
        copy = history[sample["message_id"]]
        assert (copy.payload, copy.status, copy.sent_at) == (
            sample["payload"],
            SENT,
            sample["sent_at"],
        )
        assert {r.archived_at for r in history.values()} == {now}
    else:
        assert message_ids(engine, h) == set()
    assert cleanup(engine, batch_size=1000, clock=ClockDouble(now)) == CleanupResult(0, 0, 0)


def test_cleanup_keeps_the_newest_row_so_no_id_is_handed_out_twice(
    db_url: str, engines: list[object]
) -> None:
    # SQLite gives a new row max(id) + 1: had the first cleanup emptied the outbox, the next row
    # would take id 1 again, and archiving it would collide with the history's id 1.
    engine = setup(db_url, engines)
    now = datetime(2030, 6, 1, 12, 0, 0)
    old = timedelta(days=8)
    with engine.begin() as conn:
        conn.execute(t.insert(), [row(SENT, old, now, n) for n in range(3)])
    first = cleanup(engine, archive=True, clock=ClockDouble(now))
    assert first == CleanupResult(deleted=2, archived=2, batches=1)
    with engine.begin() as conn:
        conn.execute(t.insert(), [row(SENT, old, now, 3)])

    second = cleanup(engine, archive=True, clock=ClockDouble(now))

    assert second == CleanupResult(deleted=1, archived=1, batches=1)
    with engine.connect() as conn:
        history = conn.execute(sa.select(h.c.id, h.c.aggregate_id).order_by(h.c.id)).all()
        outbox = conn.execute(sa.select(t.c.id, t.c.aggregate_id)).all()
    assert [aggregate for _, aggregate in history] == ["o-0", "o-1", "o-2"]
    assert [aggregate for _, aggregate in outbox] == ["o-3"]
    assert outbox[0][0] > history[-1][0]


def test_cleanup_walks_past_rows_it_keeps_and_ends_at_the_first_recent_row(
    db_url: str, engines: list[object]
) -> None:
    """No index holds SENT rows: cleanup walks the outbox by id, in pages of ``batch_size``."""
    engine = setup(db_url, engines)
    now = datetime(2030, 6, 1, 12, 0, 0)
    old, recent = timedelta(days=8), timedelta(days=1)
    sent_late = {**row(SENT, old, now, 25), "sent_at": now - timedelta(hours=1)}
    # A writer whose clock ran behind: created (and sent) "8 days ago", after recent rows.
    behind = row(SENT, old, now, 99)
    groups = {
        "old_failed": [row(FAILED, old, now, n) for n in range(25)],  # more than two pages
        "sent_late": [sent_late],  # created long ago, delivered after retries an hour ago
        "old_sent": [row(SENT, old, now, n) for n in range(30)],
        "recent_sent": [row(SENT, recent, now, n) for n in range(5)],
        "behind": [behind],
        "newest": [row(PENDING, recent, now, 100)],
    }
    with engine.begin() as conn:
        for rows in groups.values():
            conn.execute(t.insert(), rows)

    result = cleanup(engine, batch_size=10, clock=ClockDouble(now))

    assert result == CleanupResult(deleted=30, archived=0, batches=3)
    assert message_ids(engine, t) == kept(groups)
    # The walk ended at the first recent row; a later run, once that row is old, goes past it.
    later = ClockDouble(now + timedelta(days=7))
    assert cleanup(engine, batch_size=10, clock=later).deleted == 5 + 1 + 1  # and the late one


@pytest.mark.sqlite
def test_cleanup_stops_after_max_batches(sqlite_url: str, engines: list[object]) -> None:
    engine = setup(sqlite_url, engines)
    now = datetime(2030, 6, 1, 12, 0, 0)
    fill(engine, now)
    first = cleanup(engine, batch_size=1000, max_batches=1, clock=ClockDouble(now))
    assert first == CleanupResult(deleted=1000, archived=0, batches=1)
    rest = cleanup(engine, batch_size=1000, clock=ClockDouble(now))
    assert rest == CleanupResult(deleted=1500, archived=0, batches=2)
    with pytest.raises(ValueError):
        cleanup(engine, batch_size=0)


def test_cleanup_through_the_cli(db_url: str, engines: list[object]) -> None:
    engine = setup(db_url, engines)
    now = clock.SYSTEM.now()  # the CLI uses the wall clock
    groups = fill(engine, now)
    received = [now - timedelta(days=31), now - timedelta(days=29), now - timedelta(days=3)]
    with engine.begin() as conn:
        conn.execute(
            schema.inbox.insert(),
            [
                {"consumer": "c", "message_id": f"m-{i}", "received_at": at}
                for i, at in enumerate(received)
            ],
        )

    done = subprocess.run(
        [CLI, "cleanup", "--db", db_url, "--batch-size", "1000", "--archive"],
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "deleted": 2500,
        "archived": 2500,
        "batches": 3,
        "history": 0,  # archived just now: within the 7 days of --history-retention-days
        "inbox": 1,  # older than the 30 days of --inbox-retention-days
        "inbox_duplicates": 0,
    }
    assert message_ids(engine, t) == kept(groups)
    assert len(message_ids(engine, h)) == 2500
    assert message_ids(engine, schema.inbox) == {"m-1", "m-2"}

    shorter = [CLI, "cleanup", "--db", db_url, "--inbox-retention-days", "7"]
    done = subprocess.run(shorter, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["inbox"] == 1
    kept_all = [CLI, "cleanup", "--db", db_url, "--inbox-retention-days", "0", "--keep-inbox"]
    done = subprocess.run(kept_all, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "inbox" not in json.loads(done.stdout)
    assert message_ids(engine, schema.inbox) == {"m-2"}
    refused = subprocess.run(
        [CLI, "cleanup", "--db", db_url, "--inbox-retention-days", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "--keep-inbox" in refused.stderr


def history_row(row_id: int, archived_at: datetime) -> dict[str, Any]:
    return {
        **row(SENT, timedelta(0), archived_at, row_id),
        "id": row_id,
        "archived_at": archived_at,
    }


def test_prune_history_walks_the_history_by_id_and_keeps_what_is_recent(
    db_url: str, engines: list[object]
) -> None:
    engine = setup(db_url, engines)
    now = datetime(2030, 6, 1, 12, 0, 0)
    old, recent = now - timedelta(days=31), now - timedelta(days=29)
    # 1-2000 archived a month ago but 1500 (it waited in retry backoff), 2001-2500 recently.
    archived = {i: old if i <= 2000 and i != 1500 else recent for i in range(1, 2501)}
    with engine.begin() as conn:
        conn.execute(h.insert(), [history_row(i, at) for i, at in archived.items()])

    pruned = prune_history(
        engine, retention=timedelta(days=30), batch_size=1000, clock=ClockDouble(now)
    )

    assert pruned == 1999
    with engine.connect() as conn:
        left = set(conn.scalars(sa.select(h.c.id)))
    assert left == {1500, *range(2001, 2501)}
    later = ClockDouble(now + timedelta(days=2))  # the rest is past the retention now
    assert prune_history(engine, retention=timedelta(days=30), clock=later) == 501
    with pytest.raises(ValueError):
        prune_history(engine, retention=timedelta(days=30), batch_size=0)


def test_the_cli_prunes_the_history_after_its_retention_unless_told_to_keep_it(
    db_url: str, engines: list[object]
) -> None:
    engine = setup(db_url, engines)
    now = clock.SYSTEM.now()  # the CLI uses the wall clock
    archived = [now - timedelta(days=40), now - timedelta(days=10), now - timedelta(days=6), now]
    with engine.begin() as conn:
        conn.execute(h.insert(), [history_row(i, at) for i, at in enumerate(archived, 1)])

    def run(*options: str) -> subprocess.CompletedProcess[str]:
        command = [CLI, "cleanup", "--db", db_url, "--keep-inbox", *options]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    def history() -> list[int]:
        with engine.connect() as conn:
            return list(conn.scalars(sa.select(h.c.id).order_by(h.c.id)))

    done = run("--keep-history")
    assert done.returncode == 0, done.stderr
    assert "history" not in json.loads(done.stdout) and history() == [1, 2, 3, 4]
    done = run("--history-retention-days", "30")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["history"] == 1 and history() == [2, 3, 4]
    done = run()  # the default: 7 days
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["history"] == 1 and history() == [3, 4]
    refused = run("--history-retention-days", "0")
    assert refused.returncode != 0 and "--history-retention-days" in refused.stderr


@pytest.mark.mariadb
def test_cleanup_on_mariadb_deletes_where_a_schema_translate_map_points(
    mariadb_url: str, engines: list[object]
) -> None:
    """MariaDB's row-by-row DELETE is a construct: a mapped connection deletes from its schema."""
    engine = setup(mariadb_url, engines)
    elsewhere = f"{engine.url.database}_elsewhere"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE `{elsewhere}`")
        conn.exec_driver_sql(f"CREATE TABLE `{elsewhere}`.outbox_messages LIKE outbox_messages")
    try:
        moved = engine.execution_options(schema_translate_map={None: elsewhere})
        now = datetime(2030, 6, 1, 12, 0, 0)
        for target in (engine, moved):  # the same ids in both tables
            with target.begin() as conn:
                conn.execute(t.insert(), [row(SENT, timedelta(days=8), now, n) for n in range(3)])

        assert cleanup(moved, clock=ClockDouble(now)).deleted == 2  # the newest row stays

        with engine.connect() as conn:
            count = "SELECT count(*) FROM {}.outbox_messages"
            assert conn.exec_driver_sql(count.format(f"`{elsewhere}`")).scalar() == 1
            assert conn.exec_driver_sql(count.format(f"`{engine.url.database}`")).scalar() == 3
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE `{elsewhere}`")
