"""A partial index of PENDING outbox rows in id order, serving the relay's claim.

MySQL and MariaDB have no partial indexes; there the (status, next_retry_at, id) index serves.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 16:45:56.126823

Revisions are frozen: they must not import saga_engine.schema, whose tables keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("outbox_messages", schema=None) as batch_op:
        batch_op.create_index(
            "ix_outbox_messages_pending_id",
            ["id"],
            unique=False,
            postgresql_where=sa.text("status = 0"),
            sqlite_where=sa.text("status = 0"),
        )


def downgrade() -> None:
    with op.batch_alter_table("outbox_messages", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_outbox_messages_pending_id",
            postgresql_where=sa.text("status = 0"),
            sqlite_where=sa.text("status = 0"),
        )
