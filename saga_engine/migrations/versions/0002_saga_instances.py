"""Saga instances.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02

Revisions are frozen: they must not import saga_engine.schema, whose tables keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
LongText = sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")


def upgrade() -> None:
    op.create_table(
        "saga_instances",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("saga_type", sa.String(128), nullable=False),
        sa.Column("definition_version", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(160), nullable=False),
        sa.Column("data", LongText, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("command_id", sa.String(64)),
        sa.Column(
            "completed_steps", sa.Text(), nullable=False
        ),  # no DEFAULT: MySQL refuses one on TEXT
        sa.Column("deadline", Timestamp),
        sa.Column("deadline_kind", sa.String(16)),
        sa.Column("last_error", sa.Text()),
        sa.Column("tenant_id", sa.String(64)),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("ended_at", Timestamp),
        sa.PrimaryKeyConstraint("id", name="pk_saga_instances"),
    )
    op.create_index("ix_saga_instances_deadline", "saga_instances", ["deadline"])
    op.create_index("ix_saga_instances_saga_type_state", "saga_instances", ["saga_type", "state"])


def downgrade() -> None:
    op.drop_table("saga_instances")
