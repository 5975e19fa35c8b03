"""Outbox, inbox, dead letters and the SQL transport.

Revision ID: 0001
Revises:
Create Date: 2026-12-02

Revisions are frozen: they must not import saga_engine.schema, whose tables keep changing. The
types below are copies of the schema's helpers as they were when this revision was written.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
# MySQL's default DATETIME drops fractions of a second, which would reorder retries.
Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
# MySQL's TEXT stops at 64 KiB, below the 1 MiB payload limit.
LongText = sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")
LongBytes = sa.LargeBinary().with_variant(mysql.MEDIUMBLOB(), "mysql", "mariadb")

#: PostgreSQL: one NOTIFY per inserting statement, the relays' and consumers' wake-up hint.
POSTGRES_TRIGGERS = {
    "outbox_messages": "saga_engine_outbox",
    "transport_messages": "saga_engine_transport",
}


def _message_columns() -> list[sa.Column[object]]:
    """Columns shared by the outbox and its history table."""
    return [
        sa.Column("message_id", sa.String(64), nullable=False),
        sa.Column("aggregate_type", sa.String(64), nullable=False, server_default=""),
        sa.Column("aggregate_id", sa.String(128), nullable=False, server_default=""),
        sa.Column("message_type", sa.String(128), nullable=False),
        sa.Column("destination", sa.String(255), nullable=False),
        sa.Column("partition_key", sa.String(255), nullable=False),
        sa.Column("correlation_id", sa.String(64)),
        sa.Column("causation_id", sa.String(64)),
        sa.Column("tenant_id", sa.String(64)),
        sa.Column("headers", sa.Text(), nullable=False),  # no DEFAULT: MySQL refuses one on TEXT
        sa.Column("payload", LongText, nullable=False),
        # 0 PENDING, 1 SENT, 2 FAILED (saga_engine.schema.OutboxStatus)
        sa.Column("status", sa.SmallInteger(), nullable=False, server_default="0"),
        sa.Column("retry_count", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_retry_at", Timestamp, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("sent_at", Timestamp),
        sa.Column("last_error", sa.Text()),
    ]


def upgrade() -> None:
    op.create_table(
        "outbox_messages",
        sa.Column("id", BigId, autoincrement=True),
        *_message_columns(),
        sa.Column("claimed_by", sa.String(64)),
        sa.Column("lease_until", Timestamp),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_messages"),
        sa.UniqueConstraint("message_id", name="uq_outbox_messages_message_id"),
    )
    op.create_index(
        "ix_outbox_messages_status_next_retry_at_id",
        "outbox_messages",
        ["status", "next_retry_at", "id"],
    )
    op.create_index(
        "ix_outbox_messages_partition_key_status_id",
        "outbox_messages",
        ["partition_key", "status", "id"],
    )
    op.create_index("ix_outbox_messages_status_sent_at", "outbox_messages", ["status", "sent_at"])

    op.create_table(
        "outbox_history",
        sa.Column("id", BigId, autoincrement=False),
        *_message_columns(),
        sa.Column("archived_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_history"),
    )

    op.create_table(
        "inbox_messages",
        sa.Column("consumer", sa.String(128), nullable=False),
        sa.Column("message_id", sa.String(64), nullable=False),
        sa.Column("received_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("consumer", "message_id", name="pk_inbox_messages"),
    )

    op.create_table(
        "inbox_duplicates",
        sa.Column("id", BigId, autoincrement=True),
        sa.Column("consumer", sa.String(128), nullable=False),
        sa.Column("message_id", sa.String(64), nullable=False),
        sa.Column("seen_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_inbox_duplicates"),
    )
    op.create_index("ix_inbox_duplicates_consumer", "inbox_duplicates", ["consumer"])

    op.create_table(
        "dead_letters",
        sa.Column("id", BigId, autoincrement=True),
        sa.Column("consumer", sa.String(128), nullable=False),
        sa.Column("channel", sa.String(255), nullable=False),
        sa.Column("message_id", sa.String(64)),
        sa.Column("message_type", sa.String(128)),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("raw", LongBytes, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_dead_letters"),
    )
    op.create_index(
        "ix_dead_letters_consumer_created_at", "dead_letters", ["consumer", "created_at"]
    )

    op.create_table(
        "transport_messages",
        sa.Column("id", BigId, autoincrement=True),
        sa.Column("channel", sa.String(255), nullable=False),
        sa.Column("partition_key", sa.String(255), nullable=False),
        sa.Column("message_id", sa.String(64), nullable=False),
        sa.Column("body", LongBytes, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("lease_owner", sa.String(64)),
        sa.Column("lease_until", Timestamp),
        sa.Column("deliveries", sa.Integer(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("id", name="pk_transport_messages"),
    )
    op.create_index("ix_transport_messages_channel_id", "transport_messages", ["channel", "id"])
    op.create_index(
        "ix_transport_messages_channel_partition_key_id",
        "transport_messages",
        ["channel", "partition_key", "id"],
    )

    if op.get_context().dialect.name == "postgresql":
        for table, channel in POSTGRES_TRIGGERS.items():
            op.execute(
                f"CREATE OR REPLACE FUNCTION {table}_notify() RETURNS trigger LANGUAGE plpgsql "
                f"AS $$ BEGIN PERFORM pg_notify('{channel}', ''); RETURN NULL; END $$"
            )
            op.execute(
                f"CREATE TRIGGER {table}_notify AFTER INSERT ON {table} "
                f"FOR EACH STATEMENT EXECUTE FUNCTION {table}_notify()"
            )


def downgrade() -> None:
    for table in (
        "transport_messages",
        "dead_letters",
        "inbox_duplicates",
        "inbox_messages",
        "outbox_history",
        "outbox_messages",
    ):
        op.drop_table(table)  # drops its indexes and triggers with it
    if op.get_context().dialect.name == "postgresql":
        for table in POSTGRES_TRIGGERS:
            op.execute(f"DROP FUNCTION IF EXISTS {table}_notify()")
