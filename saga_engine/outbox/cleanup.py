"""Cleanup of delivered messages (the article's §4.4).

SENT rows older than the retention are deleted in bounded batches until none are left, each batch
its own short transaction, so cleanup never holds a long lock or builds one huge undo log. With
``archive=True`` each batch is first copied to ``outbox_history`` in the same transaction.
On PostgreSQL at very high volume, partitioning the outbox by day and dropping old partitions is
cheaper still; docs/outbox.md shows how.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy import Engine

from saga_engine import clock, db, schema

t = schema.outbox
h = schema.outbox_history
HISTORY_COLUMNS = [c.name for c in h.columns if c.name != "archived_at"]


@dataclasses.dataclass(frozen=True)
class CleanupResult:
    deleted: int
    archived: int
    batches: int


def cleanup(
    engine: Engine,
    *,
    retention: timedelta = timedelta(days=7),
    batch_size: int = 1000,
    archive: bool = False,
    clock: clock.Clock = clock.SYSTEM,
    max_batches: int | None = None,
) -> CleanupResult:
    """Delete (or archive) SENT rows older than ``retention``, ``batch_size`` rows at a time."""
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    now = clock.now()
    # Select the ids first: DELETE ... LIMIT is MySQL-only, and the id list bounds the batch on
    # every database.
    oldest = (
        sa.select(t.c.id)
        .where(t.c.status == schema.OutboxStatus.SENT, t.c.sent_at < now - retention)
        .order_by(t.c.id)
        .limit(batch_size)
    )

    def batch(conn: sa.Connection) -> dict[str, int]:
        ids = conn.scalars(oldest).all()
        if not ids:
            return {}
        archived = _archive(conn, ids, now) if archive else 0
        return {
            "deleted": conn.execute(sa.delete(t).where(t.c.id.in_(ids))).rowcount,
            "archived": archived,
        }

    totals, batches = db.delete_in_batches(engine, batch, max_batches)
    return CleanupResult(totals["deleted"], totals["archived"], batches)


def _archive(conn: sa.Connection, ids: Sequence[int], now: datetime) -> int:
    """Copy the rows ``ids`` to ``outbox_history``, stamped ``now``."""
    source = sa.select(
        *[t.c[name] for name in HISTORY_COLUMNS],
        sa.literal(now, schema.Timestamp).label("archived_at"),
    )
    conn.execute(
        h.insert().from_select([*HISTORY_COLUMNS, "archived_at"], source.where(t.c.id.in_(ids)))
    )
    return len(ids)
