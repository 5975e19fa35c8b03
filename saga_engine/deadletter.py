"""Dead letters: messages that cannot be processed, kept with their raw bytes and the reason.

Nothing is ever dropped: a message that is not JSON, has an unknown type, does not match its schema
or is addressed to an unknown saga is written here and acknowledged, so the consumer keeps going.
Dead letters are kept until an operator has seen to them, unless a retention is set (``prune``).
"""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from saga_engine import clock, db, schema

d = schema.dead_letters


def record(
    conn: Connection,
    *,
    consumer: str,
    channel: str,
    raw: bytes,
    reason: str,
    message_id: str | None = None,
    message_type: str | None = None,
    now_clock: clock.Clock = clock.SYSTEM,
) -> None:
    conn.execute(
        d.insert(),
        {
            "consumer": consumer,
            "channel": channel,
            "raw": raw,
            "reason": reason[:4000],
            "message_id": message_id,
            "message_type": message_type,
            "created_at": now_clock.now(),
        },
    )


def count(engine: Engine, consumer: str | None = None) -> int:
    stmt = sa.select(sa.func.count()).select_from(d)
    if consumer is not None:
        stmt = stmt.where(d.c.consumer == consumer)
    with engine.connect() as conn:
        return int(conn.scalar(stmt) or 0)


def prune(
    engine: Engine,
    *,
    retention: timedelta,
    batch_size: int = 1000,
    clock: clock.Clock = clock.SYSTEM,
    max_batches: int | None = None,
) -> int:
    """Delete dead letters recorded more than ``retention`` ago, ``batch_size`` at a time;
    returns how many."""
    return db.delete_older_than(
        engine,
        d.c.created_at,
        retention,
        now=clock.now(),
        batch_size=batch_size,
        max_batches=max_batches,
    )
