"""Operator actions and the monitoring signals of the outbox (the article's §6.4).

Signals: backlog (PENDING rows), failed rows, oldest pending age, delivery latency percentiles over
recently sent rows (kept in the outbox, or moved to ``outbox_history``), and table size (delivered
rows: counted in a small table, taken from the database's statistics in a large one). Operators
re-queue FAILED rows once the cause is fixed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy import Engine

from saga_engine import clock, db, schema

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


#: Up to this many rows in a table, its delivered messages are counted; above it, ``sent`` is taken
#: from the database's statistics instead. A retention of days holds hundreds of millions of
#: delivered rows, and counting them on every scrape of a metrics collector would read them all.
EXACT_SENT_UP_TO = 100_000


@dataclasses.dataclass(frozen=True)
class OutboxSignals:
    pending: int
    sent: int
    failed: int
    oldest_pending_seconds: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    #: ``sent`` came from the database's row estimates (a table over ``EXACT_SENT_UP_TO`` rows).
    sent_estimated: bool = False

    def as_dict(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)


def signals(
    engine: Engine,
    *,
    sample: int = 2000,
    clock: clock.Clock = clock.SYSTEM,
    exact_sent_up_to: int = EXACT_SENT_UP_TO,
) -> OutboxSignals:
    """The outbox's monitoring signals. ``pending`` and ``failed`` are counted (through the
    indexes of PENDING and of FAILED rows); ``sent`` is counted while a table holds at most
    ``exact_sent_up_to`` rows by the database's statistics, and estimated from them above."""
    with engine.connect() as conn:
        pending = _count(conn, t, t.c.status == schema.OutboxStatus.PENDING)
        failed = _count(conn, t, t.c.status == schema.OutboxStatus.FAILED)
        kept, kept_estimated = _sent(
            conn, t, t.c.status == schema.OutboxStatus.SENT, pending + failed, exact_sent_up_to
        )
        archived, archived_estimated = _sent(conn, h, sa.true(), 0, exact_sent_up_to)
        oldest = conn.scalar(
            sa.select(sa.func.min(t.c.created_at)).where(t.c.status == schema.OutboxStatus.PENDING)
        )
        recent = [
            *_recent_sent(conn, t, t.c.status == schema.OutboxStatus.SENT, sample),
            *_recent_sent(conn, h, sa.true(), sample),
        ]
    # The latest ``sample`` deliveries, whether kept in the outbox or moved to the history.
    recent = sorted(recent, key=lambda row: row[1], reverse=True)[:sample]
    latencies = sorted((s - c).total_seconds() * 1000 for c, s in recent)
    return OutboxSignals(
        pending=pending,
        sent=kept + archived,
        failed=failed,
        oldest_pending_seconds=(clock.now() - oldest).total_seconds() if oldest else None,
        latency_p50_ms=percentile(latencies, 0.50),
        latency_p99_ms=percentile(latencies, 0.99),
        sent_estimated=kept_estimated or archived_estimated,
    )


def _count(conn: sa.Connection, table: sa.Table, where: sa.ColumnElement[bool]) -> int:
    return int(conn.scalar(sa.select(sa.func.count()).select_from(table).where(where)) or 0)


def _sent(
    conn: sa.Connection,
    table: sa.Table,
    sent: sa.ColumnElement[bool],
    undelivered: int,
    exact_up_to: int,
) -> tuple[int, bool]:
    """Delivered rows in ``table`` and whether the figure is an estimate: its rows by the
    database's statistics less the ``undelivered`` ones counted, or a count where the table is
    small, its statistics unknown (never analyzed), or the database keeps none (SQLite)."""
    estimate = _row_estimate(conn, table)
    if estimate is None or estimate <= exact_up_to:
        return _count(conn, table, sent), False
    return max(0, estimate - undelivered), True


def _row_estimate(conn: sa.Connection, table: sa.Table) -> int | None:
    """The rows ``table`` holds by the statistics the planner keeps, or None if there are none."""
    translate = conn.get_execution_options().get("schema_translate_map") or {}
    schema_name = translate.get(table.schema, table.schema)
    dialect = db.dialect_name(conn)
    if dialect == "postgresql":
        name = f"{schema_name}.{table.name}" if schema_name else table.name
        rows = conn.scalar(
            sa.text("SELECT reltuples FROM pg_class WHERE oid = to_regclass(:name)"),
            {"name": name},
        )
        # -1: never vacuumed or analyzed (PostgreSQL 14 and later), so unknown.
        return None if rows is None or rows < 0 else int(rows)
    if dialect == "mysql":
        rows = conn.scalar(
            sa.text(
                "SELECT table_rows FROM information_schema.tables"
                " WHERE table_schema = COALESCE(:schema, DATABASE()) AND table_name = :name"
            ),
            {"schema": schema_name, "name": table.name},
        )
        return None if rows is None else int(rows)
    return None


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
