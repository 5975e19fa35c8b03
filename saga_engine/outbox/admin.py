"""Operator actions and the monitoring signals of the outbox (the article's §6.4).

Signals: backlog (PENDING rows), failed rows, oldest pending age, delivery latency percentiles over
recently sent rows (kept in the outbox, or moved to ``outbox_history``), and table size. Operators
re-queue FAILED rows once the cause is fixed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy import Engine

from saga_engine import clock, schema

t = schema.outbox
h = schema.outbox_history


def requeue_failed(
    engine: Engine, message_ids: Sequence[str] | None = None, *, clock: clock.Clock = clock.SYSTEM
) -> int:
    """Put FAILED rows (all, or those named) back to PENDING with a fresh retry budget."""
    stmt = sa.update(t).where(t.c.status == schema.OutboxStatus.FAILED)
    if message_ids is not None:
        stmt = stmt.where(t.c.message_id.in_(list(message_ids)))
    now = clock.now()
    with engine.begin() as conn:
        return int(
            conn.execute(
                stmt.values(
                    status=schema.OutboxStatus.PENDING,
                    retry_count=0,
                    next_retry_at=now,
                    updated_at=now,
                    claimed_by=None,
                    lease_until=None,
                )
            ).rowcount
        )


@dataclasses.dataclass(frozen=True)
class OutboxSignals:
    pending: int
    sent: int
    failed: int
    oldest_pending_seconds: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None

    def as_dict(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)


def signals(
    engine: Engine, *, sample: int = 2000, clock: clock.Clock = clock.SYSTEM
) -> OutboxSignals:
    with engine.connect() as conn:
        counts: dict[int, int] = dict(
            conn.execute(sa.select(t.c.status, sa.func.count()).group_by(t.c.status)).all()
        )
        oldest = conn.scalar(
            sa.select(sa.func.min(t.c.created_at)).where(t.c.status == schema.OutboxStatus.PENDING)
        )
        archived = conn.scalar(sa.select(sa.func.count()).select_from(h)) or 0
        recent = [
            *_recent_sent(conn, t, t.c.status == schema.OutboxStatus.SENT, sample),
            *_recent_sent(conn, h, sa.true(), sample),
        ]
    # The latest ``sample`` deliveries, whether kept in the outbox or moved to the history.
    recent = sorted(recent, key=lambda row: row[1], reverse=True)[:sample]
    latencies = sorted((s - c).total_seconds() * 1000 for c, s in recent)
    return OutboxSignals(
        pending=counts.get(schema.OutboxStatus.PENDING, 0),
        sent=counts.get(schema.OutboxStatus.SENT, 0) + archived,
        failed=counts.get(schema.OutboxStatus.FAILED, 0),
        oldest_pending_seconds=(clock.now() - oldest).total_seconds() if oldest else None,
        latency_p50_ms=percentile(latencies, 0.50),
        latency_p99_ms=percentile(latencies, 0.99),
    )


def _recent_sent(
    conn: sa.Connection, table: sa.Table, sent: sa.ColumnElement[bool], sample: int
) -> list[tuple[datetime, datetime]]:
    """(created_at, sent_at) of the ``sample`` latest rows of ``table`` that were delivered."""
    latest = (
        sa.select(table.c.created_at, table.c.sent_at)
        .where(sent, table.c.sent_at.is_not(None))
        .order_by(table.c.id.desc())
        .limit(sample)
    )
    return [(created, sent_at) for created, sent_at in conn.execute(latest)]


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return round(sorted_values[index], 3)
