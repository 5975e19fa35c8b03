"""What ``saga-engine status`` reports: sagas by type and state, the outbox signals, inbox
duplicates, dead letters, and the sagas that need an operator (FAILED, with their errors)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine

from saga_engine import deadletter, schema, store
from saga_engine.outbox import admin

s = schema.saga_instances


def collect(engine: Engine, failed_sample: int = 10) -> dict[str, Any]:
    with engine.connect() as conn:
        sagas = store.counts(conn)
        duplicates = conn.scalar(sa.select(sa.func.count()).select_from(schema.inbox_duplicates))
        failed = conn.execute(
            sa.select(s.c.id, s.c.saga_type, s.c.last_error)
            .where(s.c.state == "FAILED")
            .order_by(s.c.updated_at.desc())
            .limit(failed_sample)
        ).all()
    signals = admin.signals(engine).as_dict()
    return {
        "sagas": sagas,
        "outbox": signals,
        "inbox_duplicates": int(duplicates or 0),
        "dead_letters": deadletter.count(engine),
        "needs_attention": [
            {"saga_id": row.id, "saga_type": row.saga_type, "error": row.last_error}
            for row in failed
        ],
    }


def render(report: dict[str, Any], where: str) -> str:
    lines = [f"database: {where}", "", "sagas"]
    if not report["sagas"]:
        lines.append("  (none)")
    for saga_type, states in sorted(report["sagas"].items()):
        total = sum(states.values())
        detail = ", ".join(f"{state} {n}" for state, n in sorted(states.items()))
        lines.append(f"  {saga_type:<24} {total:>8}  {detail}")
    o = report["outbox"]
    lines += [
        "",
        "outbox",
        f"  pending {o['pending']}, sent {'about ' if o['sent_estimated'] else ''}{o['sent']}, "
        f"failed {o['failed']}",
        f"  oldest pending: {_seconds(o['oldest_pending_seconds'])}, delivery latency p50 "
        f"{_ms(o['latency_p50_ms'])}, p99 {_ms(o['latency_p99_ms'])}",
        "",
        f"inbox duplicates absorbed: {report['inbox_duplicates']}",
        f"dead letters: {report['dead_letters']}",
    ]
    if report["needs_attention"]:
        lines += ["", "needs attention (FAILED)"]
        lines += [
            f"  {f['saga_type']} {f['saga_id']}: {f['error']}" for f in report["needs_attention"]
        ]
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"
