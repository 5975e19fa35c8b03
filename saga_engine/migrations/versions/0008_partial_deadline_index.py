"""The index of deadlines holds only the sagas that have one.

The deadlines role asks for passed deadlines (``saga_engine.store.due``) every 0.2 s in every
worker. A full index on ``saga_instances.deadline`` took an entry for every saga and for every
step's update of it, though a saga has a deadline only while it waits on a timeout or a retry
back-off, and an ended saga never has one. Partial where the database has partial indexes
(PostgreSQL, SQLite); MySQL and MariaDB keep the full index.

``store.due`` asks for ``deadline <= now``, which implies ``deadline IS NOT NULL``, so it reads the
partial index as it read the full one.

Building it reads ``saga_instances`` once; on PostgreSQL writers to it wait for that read, so
upgrade a large table in a quiet moment.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 09:45:00.000000

Revisions are frozen: they must not import saga_engine.schema, whose tables keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEX = "ix_saga_instances_deadline"
WITH_DEADLINE: dict[str, Any] = {
    "postgresql_where": sa.text("deadline IS NOT NULL"),
    "sqlite_where": sa.text("deadline IS NOT NULL"),
}


def upgrade() -> None:
    if op.get_context().dialect.name in ("mysql", "mariadb"):
        return  # no partial indexes: the full index stays as it is
    with op.batch_alter_table("saga_instances", schema=None) as batch_op:
        batch_op.drop_index(INDEX)
        batch_op.create_index(INDEX, ["deadline"], unique=False, **WITH_DEADLINE)


def downgrade() -> None:
    if op.get_context().dialect.name in ("mysql", "mariadb"):
        return
    with op.batch_alter_table("saga_instances", schema=None) as batch_op:
        batch_op.drop_index(INDEX)
        batch_op.create_index(INDEX, ["deadline"], unique=False)
