"""Dead letters: messages that cannot be processed, kept with their raw bytes and the reason.

Nothing is ever dropped: a message that is not JSON, has an unknown type, does not match its schema
or is addressed to an unknown saga is written here and acknowledged, so the consumer keeps going.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from saga_engine import clock, schema

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
