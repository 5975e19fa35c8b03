"""Saga instances in the database, with optimistic concurrency.

Every change is ``UPDATE ... WHERE id = ? AND version = <version read>``; a row count of zero means
someone else changed the instance first (:class:`errors.ConcurrentUpdate`), and the caller's whole
transaction is retried from a fresh read.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from saga_engine import clock, db, errors, schema

s = schema.saga_instances


@dataclasses.dataclass
class SagaInstance:
    id: str
    saga_type: str
    definition_version: int
    state: str
    data: dict[str, Any]
    version: int = 0
    attempt: int = 0
    command_id: str | None = None
    completed_steps: list[str] = dataclasses.field(default_factory=list)
    deadline: datetime | None = None
    deadline_kind: str | None = None
    last_error: str | None = None
    tenant_id: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    ended_at: datetime | None = None

    def wait_until(self, deadline: datetime | None, kind: str | None) -> None:
        self.deadline, self.deadline_kind = deadline, kind


def _row(instance: SagaInstance) -> dict[str, Any]:
    values = dataclasses.asdict(instance)
    values["data"] = json.dumps(instance.data, separators=(",", ":"))
    values["completed_steps"] = json.dumps(instance.completed_steps)
    return values


def insert(conn: Connection, instance: SagaInstance, now: datetime) -> None:
    instance.created_at = instance.updated_at = now
    conn.execute(_INSERT, _row(instance))


#: Built once: a saga's every message loads and saves its instance, and building the statement
#: anew each time cost as much client CPU as executing it.
_LOAD = sa.select(s).where(s.c.id == sa.bindparam("saga_id"))
_INSERT = s.insert()
#: ``SET`` takes every column the parameters name (the same ones on every call).
_SAVE = sa.update(s).where(
    s.c.id == sa.bindparam("b_id"), s.c.version == sa.bindparam("b_read_version")
)


def load(conn: Connection, saga_id: str) -> SagaInstance | None:
    row = conn.execute(_LOAD, {"saga_id": saga_id}).mappings().first()
    if row is None:
        return None
    values = dict(row)
    values["data"] = json.loads(values["data"])
    values["completed_steps"] = json.loads(values["completed_steps"])
    return SagaInstance(**values)


def save(conn: Connection, instance: SagaInstance, now: datetime) -> None:
    """Write ``instance`` if nobody changed it since it was read; bumps its version."""
    values = _row(instance)
    read_version = values.pop("version")
    values.pop("id")
    values.pop("created_at")
    values.update(
        updated_at=now, version=read_version + 1, b_id=instance.id, b_read_version=read_version
    )
    result = conn.execute(_SAVE, values)
    if result.rowcount != 1:
        raise errors.ConcurrentUpdate(f"saga {instance.id} changed since version {read_version}")
    instance.version = read_version + 1
    instance.updated_at = now


def due(conn: Connection, now: datetime, limit: int) -> Sequence[str]:
    """Ids of sagas whose stored deadline has passed, oldest first."""
    return conn.scalars(
        sa.select(s.c.id).where(s.c.deadline <= now).order_by(s.c.deadline).limit(limit)
    ).all()


def counts(conn: Connection) -> dict[str, dict[str, int]]:
    """Saga counts by type and state."""
    out: dict[str, dict[str, int]] = {}
    for saga_type, state, n in conn.execute(
        sa.select(s.c.saga_type, s.c.state, sa.func.count()).group_by(s.c.saga_type, s.c.state)
    ):
        out.setdefault(saga_type, {})[state] = int(n)
    return out


def prune_ended(
    engine: Engine,
    *,
    retention: timedelta,
    batch_size: int = 1000,
    clock: clock.Clock = clock.SYSTEM,
    max_batches: int | None = None,
) -> int:
    """Delete sagas that ended (COMPLETED, COMPENSATED or FAILED) more than ``retention`` ago,
    ``batch_size`` at a time; returns how many. A saga still running has no ``ended_at`` and is
    never touched, however old. A reply that arrives for a deleted saga becomes a dead letter
    (``unknown saga id``), so keep sagas longer than the inbox remembers message ids."""
    return db.delete_older_than(
        engine,
        s.c.ended_at,
        retention,
        now=clock.now(),
        batch_size=batch_size,
        max_batches=max_batches,
    )
