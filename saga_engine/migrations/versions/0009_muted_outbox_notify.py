"""The outbox's NOTIFY falls silent while a relay holds the mute.

Every statement that inserts into ``outbox_messages`` sent a NOTIFY, the relays' wake-up hint.
Under load a relay passes on a timer of its own and the NOTIFYs say nothing new, yet
PostgreSQL serializes the commits of every transaction that sent one and signals every listener
at each. The trigger now sends its NOTIFY only when no relay holds the mute; a writer that finds it
held takes the writers' advisory lock (shared, until the transaction ends) and looks again, so the
relay can wait for it before it listens again (both keyed by the table's oid; see
``saga_engine.outbox.pacing.Mute``). Relays of earlier versions never take the mute, so with them
every insert notifies, as before. PostgreSQL only; nothing to do elsewhere.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 13:30:00.000000

Revisions are frozen: they must not import saga_engine.schema, whose tables keep changing.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

MUTE_LOCK_SPACE = 0x5A6B
WRITERS_LOCK_SPACE = 0x5A6C
KEY = "TG_RELID::int"
CHANNEL = "saga_engine_outbox"

FREE = f"pg_try_advisory_lock_shared({MUTE_LOCK_SPACE}, {KEY})"
MUTED = (
    f"IF NOT {FREE} THEN "
    f"PERFORM pg_advisory_xact_lock_shared({WRITERS_LOCK_SPACE}, {KEY}); "
    f"IF NOT {FREE} THEN RETURN NULL; END IF; END IF; "
    f"PERFORM pg_advisory_unlock_shared({MUTE_LOCK_SPACE}, {KEY}); "
    f"PERFORM pg_notify('{CHANNEL}', '');"
)
ALWAYS = f"PERFORM pg_notify('{CHANNEL}', '');"


def _replace_function(body: str) -> None:
    # The trigger calls the function by name: replacing the function is the whole change.
    op.execute(
        "CREATE OR REPLACE FUNCTION outbox_messages_notify() RETURNS trigger LANGUAGE plpgsql "
        f"AS $$ BEGIN {body} RETURN NULL; END $$"
    )


def upgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        _replace_function(MUTED)


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        _replace_function(ALWAYS)
