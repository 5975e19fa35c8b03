"""The claim's and the order guard's outbox indexes hold PENDING rows only.

Marking a row SENT changes its ``status``; every full index on the table then takes a new entry for
it. Partial indexes (``WHERE status = 0``) take none, so the relay's mark costs two index inserts
fewer per row. MySQL and MariaDB have no partial indexes; their indexes stay as they are.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 09:05:00.000000

Revisions are frozen: they must not import saga_engine.schema, whose tables keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = {
    "ix_outbox_messages_status_next_retry_at_id": ["status", "next_retry_at", "id"],
    "ix_outbox_messages_partition_key_status_id": ["partition_key", "status", "id"],
}
PENDING_ONLY = {
    "postgresql_where": sa.text("status = 0"),
    "sqlite_where": sa.text("status = 0"),
}


def upgrade() -> None:
    _rebuild(partial=True)


def downgrade() -> None:
    _rebuild(partial=False)


def _rebuild(*, partial: bool) -> None:
    if op.get_bind().dialect.name not in ("postgresql", "sqlite"):
        return  # no partial indexes: nothing changes
    with op.batch_alter_table("outbox_messages", schema=None) as batch_op:
        for name, columns in INDEXES.items():
            batch_op.drop_index(name)
            batch_op.create_index(name, columns, unique=False, **(PENDING_ONLY if partial else {}))
