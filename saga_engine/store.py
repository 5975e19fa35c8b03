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


#: The instance's fields, in order. ``dataclasses.asdict`` deep-copies every value, which cost more
#: client CPU than the rest of a save.
_FIELDS = tuple(f.name for f in dataclasses.fields(SagaInstance))


def _row(instance: SagaInstance) -> dict[str, Any]:
    values = {name: getattr(instance, name) for name in _FIELDS}
    values["data"] = json.dumps(instance.data, separators=(",", ":"))
    values["completed_steps"] = json.dumps(instance.completed_steps)
    return values


def insert(conn: Connection, instance: SagaInstance, now: datetime) -> None:
    _INSERT.execute(conn, _new_row(instance, now))


def _new_row(instance: SagaInstance, now: datetime) -> dict[str, Any]:
    instance.created_at = instance.updated_at = now
    return _row(instance)


#: The prefix of the insert's parameters where it rides in another statement as a ``WITH`` clause
#: (PostgreSQL): the outbox's columns share some of its names (``tenant_id``, ``created_at``).
CARRIED = "saga_"
#: The insert as a ``WITH`` clause, and the parameters it takes: :func:`carried_row`'s keys.
CARRIED_INSERT = s.insert().values({name: sa.bindparam(CARRIED + name) for name in _FIELDS})
CARRIED_KEYS = tuple(CARRIED + name for name in _FIELDS)


def carried_row(instance: SagaInstance, now: datetime) -> dict[str, Any]:
    """The parameters of :data:`CARRIED_INSERT` for a new ``instance`` (as :func:`insert` does)."""
    return {CARRIED + name: value for name, value in _new_row(instance, now).items()}


#: Built once: a saga's every message loads and saves its instance, and building the statement
#: anew each time cost as much client CPU as executing it.
#: The instance's columns in ``_FIELDS`` order: a row read is zipped with ``_FIELDS``, which costs
#: a fraction of what a ``RowMapping`` does (it makes a view of its keys on every access).
_SELECT = sa.select(*(s.c[name] for name in _FIELDS))
_LOAD = _SELECT.where(s.c.id == sa.bindparam("saga_id"))
#: By a list of ids: one array parameter on PostgreSQL (see ``db.in_list``), where an expanding
#: ``IN`` renders and binds a new text for every number of ids a batch reads.
_LOAD_MANY = {
    array: _SELECT.where(db.in_list(s.c.id, "saga_ids", array=array)) for array in (True, False)
}
#: ``inline``: no ``RETURNING``; the id is the instance's own.
_INSERT = db.DriverStatement(s.insert().inline(), _FIELDS)
#: What a save never changes.
_KEPT = ("id", "created_at")
#: ``SET`` takes every column the parameters name: all but ``_KEPT``.
_SAVE_KEYS = [*(name for name in _FIELDS if name not in _KEPT), "b_id", "b_read_version"]
_SAVE = db.DriverStatement(
    sa.update(s).where(
        s.c.id == sa.bindparam("b_id"), s.c.version == sa.bindparam("b_read_version")
    ),
    _SAVE_KEYS,
    arrays=db.ArrayRows.update(s, _SAVE_KEYS, where={"id": "b_id", "version": "b_read_version"}),
)


def load(conn: Connection, saga_id: str) -> SagaInstance | None:
    row = conn.execute(_LOAD, {"saga_id": saga_id}).first()
    return None if row is None else _instance(row)


def load_many(conn: Connection, saga_ids: Sequence[str]) -> dict[str, SagaInstance]:
    """The instances of ``saga_ids`` that exist, by id, read with one statement."""
    if not saga_ids:
        return {}
    statement = _LOAD_MANY[db.uses_arrays(conn.dialect)]
    rows = conn.execute(statement, {"saga_ids": list(set(saga_ids))}).all()
    instances = (_instance(row) for row in rows)
    return {instance.id: instance for instance in instances}


def _instance(row: Sequence[Any]) -> SagaInstance:
    values = dict(zip(_FIELDS, row, strict=True))
    values["data"] = json.loads(values["data"])
    values["completed_steps"] = json.loads(values["completed_steps"])
    return SagaInstance(**values)


def save(conn: Connection, instance: SagaInstance, now: datetime) -> None:
    """Write ``instance`` if nobody changed it since it was read; bumps its version."""
    save_many(conn, [(instance, instance.version)], now)


def save_many(conn: Connection, changes: Sequence[tuple[SagaInstance, int]], now: datetime) -> None:
    """Write each ``(instance, version it was read at)`` if its row still has that version, with
    one statement (see ``db.ArrayRows``; an executemany off PostgreSQL); set the instances'
    versions to the one after it.

    Raises :class:`errors.ConcurrentUpdate` if any row had changed: the caller's transaction must
    then be rolled back, since the other rows were written.
    """
    if not changes:
        return
    params = [_save_params(instance, read_version, now) for instance, read_version in changes]
    result = _SAVE.execute(conn, params)
    if result.rowcount != len(params):
        raise errors.ConcurrentUpdate(_stale(changes, result.rowcount))
    for instance, read_version in changes:
        instance.version = read_version + 1
        instance.updated_at = now


def _stale(changes: Sequence[tuple[SagaInstance, int]], written: int) -> str:
    if len(changes) == 1:
        instance, read_version = changes[0]
        return f"saga {instance.id} changed since version {read_version}"
    return f"{len(changes) - written} of {len(changes)} sagas changed since they were read"


def _save_params(instance: SagaInstance, read_version: int, now: datetime) -> dict[str, Any]:
    values = _row(instance)
    for name in _KEPT:
        del values[name]
    values.update(
        updated_at=now, version=read_version + 1, b_id=instance.id, b_read_version=read_version
    )
    return values


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
