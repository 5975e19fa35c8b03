"""No index of SENT rows: marking a row SENT writes one index entry fewer.

``ix_outbox_messages_status_sent_at`` served the cleanup's ``WHERE status = 1 AND sent_at <
cutoff``, and took a new entry for every row the relay marked SENT. Cleanup now walks the outbox by
id (``saga_engine.outbox.cleanup``). FAILED rows, which operators count and re-queue, get an index
of their own, partial where the database has partial indexes, so a mark adds nothing to it.
Building it reads the outbox once; on PostgreSQL writers to the outbox wait for that read, so
upgrade a large outbox in a quiet moment.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 00:10:00.000000

Revisions are frozen: they must not import saga_engine.schema, whose tables keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FAILED_ONLY = {
    "postgresql_where": sa.text("status = 2"),
    "sqlite_where": sa.text("status = 2"),
}


def upgrade() -> None:
    with op.batch_alter_table("outbox_messages", schema=None) as batch_op:
        batch_op.create_index(
            "ix_outbox_messages_status_id", ["status", "id"], unique=False, **FAILED_ONLY
        )
        batch_op.drop_index("ix_outbox_messages_status_sent_at")


def downgrade() -> None:
    with op.batch_alter_table("outbox_messages", schema=None) as batch_op:
        batch_op.create_index(
            "ix_outbox_messages_status_sent_at", ["status", "sent_at"], unique=False
        )
        batch_op.drop_index("ix_outbox_messages_status_id")
