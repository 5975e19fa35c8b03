"""An index of the inbox by ``received_at``, so that pruning old entries seeks instead of scanning.

The inbox's primary key is ``(consumer, message_id)``; without this index, every batch of
``saga_engine.inbox.prune`` would read the whole table to find its oldest rows.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 16:00:00.000000

Revisions are frozen: they must not import saga_engine.schema, whose tables keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("inbox_messages", schema=None) as batch_op:
        batch_op.create_index("ix_inbox_messages_received_at", ["received_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("inbox_messages", schema=None) as batch_op:
        batch_op.drop_index("ix_inbox_messages_received_at")
