"""Indexes by age for the two tables the cleanup learned to prune: ended sagas and dead letters.

``saga_engine.store.prune_ended`` deletes sagas that ended longer ago than their retention and
``saga_engine.deadletter.prune`` dead letters recorded longer ago than theirs. Without these
indexes every batch of either would read its whole table to find the oldest rows.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 19:30:00.000000

Revisions are frozen: they must not import saga_engine.schema, whose tables keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Only ended sagas, where the database has partial indexes (MySQL and MariaDB index every row):
# each step of a running saga rewrites its row, and a full index would take an entry every time.
ENDED_ONLY: dict[str, Any] = {
    "postgresql_where": sa.text("ended_at IS NOT NULL"),
    "sqlite_where": sa.text("ended_at IS NOT NULL"),
}

INDEXES: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    ("saga_instances", "ix_saga_instances_ended_at", "ended_at", ENDED_ONLY),
    ("dead_letters", "ix_dead_letters_created_at", "created_at", {}),
)


def upgrade() -> None:
    for table, name, column, where in INDEXES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_index(name, [column], unique=False, **where)


def downgrade() -> None:
    for table, name, _, _ in reversed(INDEXES):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_index(name)
