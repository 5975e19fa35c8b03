"""Operator actions and the monitoring signals of the outbox (the article's §6.4).

Signals: backlog (PENDING rows), failed rows, oldest pending age, delivery latency percentiles over
recently sent rows, and table size. Operators re-queue FAILED rows once the cause is fixed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy import Engine

from saga_engine import clock, schema

t = schema.outbox


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
        recent = conn.execute(
            sa.select(t.c.created_at, t.c.sent_at)
            .where(t.c.status == schema.OutboxStatus.SENT)
            .order_by(t.c.id.desc())
            .limit(sample)
        ).all()
    latencies = sorted((s - c).total_seconds() * 1000 for c, s in recent if s is not None)
    return OutboxSignals(
        pending=counts.get(schema.OutboxStatus.PENDING, 0),
        sent=counts.get(schema.OutboxStatus.SENT, 0),
        failed=counts.get(schema.OutboxStatus.FAILED, 0),
        oldest_pending_seconds=(clock.now() - oldest).total_seconds() if oldest else None,
        latency_p50_ms=percentile(latencies, 0.50),
        latency_p99_ms=percentile(latencies, 0.99),
    )


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return round(sorted_values[index], 3)
