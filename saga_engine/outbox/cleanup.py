"""Cleanup of delivered messages (the article's §4.4).

SENT rows older than the retention are deleted in bounded batches until none are left, each batch
its own short transaction, so cleanup never holds a long lock or builds one huge undo log. With
``archive=True`` each batch is first copied to ``outbox_history`` in the same transaction.
``prune_history`` deletes history rows past a retention of their own (the history is kept
whole unless asked).
On PostgreSQL at very high volume, partitioning the outbox by day and dropping old partitions is
cheaper still; docs/outbox.md shows how.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine

from saga_engine import clock, db, schema
from saga_engine.outbox import claim as claims

t = schema.outbox
h = schema.outbox_history

#: How long delivered messages are kept by default: as SENT rows in the outbox (relays with
#: ``on_sent="mark"``, the default but on PostgreSQL), and in ``outbox_history`` (archived by
#: relays, the default on PostgreSQL, or by ``cleanup(archive=True)``), counted from when they
#: were archived.
RETENTION = timedelta(days=7)
HISTORY_RETENTION = RETENTION
SENT = schema.OutboxStatus.SENT


@dataclasses.dataclass(frozen=True)
class CleanupResult:
    deleted: int
    archived: int
    batches: int


def cleanup(
    engine: Engine,
    *,
    retention: timedelta = RETENTION,
    batch_size: int = 1000,
    archive: bool = False,
    clock: clock.Clock = clock.SYSTEM,
    max_batches: int | None = None,
) -> CleanupResult:
    """Delete (or archive) SENT rows older than ``retention``, ``batch_size`` rows at a time.

    No index holds SENT rows, so that marking a row SENT costs one index entry fewer: cleanup walks
    the outbox by id instead (see :class:`_SentWalk`). The outbox's newest row is always kept (see
    there), so an idle outbox keeps one SENT row.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    now = clock.now()
    walk = _SentWalk(now - retention, batch_size)

    def batch(conn: sa.Connection) -> dict[str, int]:
        ids = walk.next_batch(conn)
        if not ids:
            return {}
        # Deleted by id: DELETE ... LIMIT is MySQL-only, and the ids bound the batch everywhere.
        archived = _archive(conn, ids, now) if archive else 0
        return {"deleted": _delete(conn, ids), "archived": archived}

    totals, batches = db.delete_in_batches(engine, batch, max_batches)
    return CleanupResult(totals["deleted"], totals["archived"], batches)


@dataclasses.dataclass
class _SentWalk:
    """Cleanup's walk through the outbox by id, from the lowest, in pages of ``size`` rows.

    A SENT row is old enough when its ``sent_at`` is before the ``cutoff``. No row is sent before
    it is created, and rows are created in about the order of their ids, so the walk ends at the
    first row created after the cutoff: the rows beyond it are too recent. What it steps over
    (PENDING and FAILED rows, and rows sent late after retries) it reads again on the next run,
    which costs little: they are few, and a row sent late goes once it is old enough. A row whose
    writer's clock ran ahead ends a run early; the next run goes past it once it has aged.

    The outbox's newest row is never walked, however old: SQLite, and MySQL before 8.0 once it
    restarts, give a new row the highest id in the table plus one, so with the newest row gone
    they would hand out again an id that outbox_history already holds.
    """

    cutoff: datetime
    size: int
    #: Every id up to here has been walked.
    after: int = 0
    done: bool = False
    #: The next page's rows (built once per walk, from ``size``).
    page: sa.Select[Any] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        newest = sa.select(sa.func.max(t.c.id)).scalar_subquery()
        self.page = (
            sa.select(t.c.id, t.c.status, t.c.sent_at, t.c.created_at)
            .where(t.c.id > sa.bindparam("after"), t.c.id < newest)
            .order_by(t.c.id)
            .limit(self.size)
        )

    def next_batch(self, conn: sa.Connection) -> list[int]:
        """The ids of the next ``size`` rows old enough to go (fewer at the end of the walk)."""
        old: list[int] = []
        while not self.done:
            rows = conn.execute(self.page, {"after": self.after}).all()
            for row_id, status, sent_at, created_at in rows:
                if created_at >= self.cutoff:
                    self.done = True
                    return old
                self.after = row_id
                if status == SENT and sent_at is not None and sent_at < self.cutoff:
                    old.append(row_id)
                    if len(old) == self.size:
                        return old
            self.done = len(rows) < self.size
        return old


def prune_history(
    engine: Engine,
    *,
    retention: timedelta,
    batch_size: int = 1000,
    clock: clock.Clock = clock.SYSTEM,
    max_batches: int | None = None,
) -> int:
    """Delete ``outbox_history`` rows archived longer ago than ``retention``; how many.

    The history has no index but its primary key, so that archiving a row costs one index entry
    (``RelayConfig.on_sent="archive"``). Rows are archived in about the order of their ids, so
    this walks the table by id from the lowest, ``batch_size`` rows at a time, and stops at the
    first batch in which no row is old enough. A row archived out of order (one that waited in
    retry backoff) goes in a later run, once the rows before it have gone.
    """
    db.check_pruning(batch_size, retention)
    cutoff = clock.now() - retention
    after = -1  # the walk's position: every id up to it was old enough, or kept

    def batch(conn: sa.Connection) -> dict[str, int]:
        nonlocal after
        rows = conn.execute(
            sa.select(h.c.id, h.c.archived_at)
            .where(h.c.id > after)
            .order_by(h.c.id)
            .limit(batch_size)
        ).all()
        old = [row_id for row_id, archived_at in rows if archived_at < cutoff]
        if not old:
            return {}
        after = rows[-1][0]
        return {"deleted": conn.execute(sa.delete(h).where(h.c.id.in_(old))).rowcount}

    totals, _ = db.delete_in_batches(engine, batch, max_batches)
    return totals["deleted"]


def _delete(conn: sa.Connection, ids: Sequence[int]) -> int:
    # On MySQL and MariaDB one row at a time, or it may wait for PENDING rows a relay holds.
    if db.dialect_name(conn) == "mysql":
        return claims.delete_rows(conn, ids)
    return conn.execute(_DELETE, {"ids": ids}).rowcount


_DELETE = sa.delete(t).where(t.c.id.in_(sa.bindparam("ids", expanding=True)))


def _archive(conn: sa.Connection, ids: Sequence[int], now: datetime) -> int:
    """Copy the rows ``ids`` to ``outbox_history``, stamped ``now``."""
    rows = history_rows(t, sa.literal(now, schema.Timestamp)).where(t.c.id.in_(ids))
    conn.execute(h.insert().from_select(HISTORY_COLUMNS, rows))
    return len(ids)


#: ``outbox_history``'s columns in the order :func:`history_rows` selects them.
HISTORY_COLUMNS = [*schema.ARCHIVED_COLUMNS, "archived_at"]


def history_rows(
    source: sa.TableClause | sa.CTE,
    archived_at: sa.ColumnElement[Any],
    stamped: Mapping[str, sa.ColumnElement[Any]] | None = None,
) -> sa.Select[Any]:
    """The outbox rows of ``source`` as ``outbox_history`` rows (``HISTORY_COLUMNS``), with the
    columns named in ``stamped`` replaced. Every column is labelled by position, so one bound
    value may fill several of them."""
    stamped = stamped or {}
    values = [stamped.get(name, source.c[name]) for name in schema.ARCHIVED_COLUMNS]
    return sa.select(*(v.label(f"archived_{i}") for i, v in enumerate([*values, archived_at])))
