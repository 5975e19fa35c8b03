"""Every table the engine uses, defined once with SQLAlchemy Core.

The Alembic migrations in ``saga_engine/migrations`` create exactly these (a test compares them).
Types are chosen to behave the same on PostgreSQL, MariaDB/MySQL and SQLite:
microsecond DATETIME on MySQL (its default drops fractions, which would reorder retries), MEDIUMTEXT
for payloads (MySQL's TEXT stops at 64 KiB, below the 1 MiB payload limit), INTEGER ids on SQLite
(only ``INTEGER PRIMARY KEY`` autoincrements there).
"""

from __future__ import annotations

import enum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Timestamp = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
LongText = sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")
LongBytes = sa.LargeBinary().with_variant(mysql.MEDIUMBLOB(), "mysql", "mariadb")


class OutboxStatus(enum.IntEnum):
    """``outbox_messages.status``; small integers as in the article's table."""

    PENDING = 0
    SENT = 1
    FAILED = 2


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
        sa.Column("status", sa.SmallInteger(), nullable=False, server_default="0"),
        sa.Column("retry_count", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_retry_at", Timestamp, nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("sent_at", Timestamp),
        sa.Column("last_error", sa.Text()),
    ]


def _partial(condition: str) -> dict[str, Any]:
    """``sa.Index`` options for an index of the rows matching ``condition`` only, where the
    database has partial indexes (PostgreSQL, SQLite; MySQL and MariaDB index every row)."""
    where = sa.text(condition)
    return {"postgresql_where": where, "sqlite_where": where}


#: The outbox's partial indexes hold PENDING rows only.
PENDING_ONLY = _partial("status = 0")
#: The index of FAILED rows holds those only.
FAILED_ONLY = _partial("status = 2")
#: The index of deadlines holds the sagas that have one (waiting on a timeout or a retry back-off).
WITH_DEADLINE = _partial("deadline IS NOT NULL")
#: The saga index by age holds ended sagas only.
ENDED_ONLY = _partial("ended_at IS NOT NULL")

outbox = sa.Table(
    "outbox_messages",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    *_message_columns(),
    # Optimistic claim (servers without SKIP LOCKED, and SQLite): who holds the row, until when.
    sa.Column("claimed_by", sa.String(64)),
    sa.Column("lease_until", Timestamp),
    sa.UniqueConstraint("message_id"),
    # The claim query: WHERE status = 0 AND next_retry_at <= now ORDER BY id (MySQL), and the rows
    # in retry backoff (everywhere). Partial where the database allows, like the order guard's
    # index below: a row marked SENT then leaves the index without a new entry, where a full index
    # takes one more insert per marked row (claim + mark of 100k rows in batches of 500 on
    # PostgreSQL: 1.07 s -> 0.91 s).
    sa.Index(None, "status", "next_retry_at", "id", **PENDING_ONLY),
    # The same claim where partial indexes exist: only PENDING rows, already in id order, so a
    # claim does not walk past the SENT rows kept for the retention (35-57 ms -> 1.2 ms at 25k).
    sa.Index("ix_outbox_messages_pending_id", "id", **PENDING_ONLY),
    # The order guard: the earliest unsent row of each partition key.
    sa.Index(None, "partition_key", "status", "id", **PENDING_ONLY),
    # FAILED rows, for an operator: counted by `outbox signals`, re-queued by `outbox requeue`.
    # No index holds SENT rows: each would take an entry for every marked row, and cleanup walks
    # the table by id instead (saga_engine.outbox.cleanup).
    sa.Index(None, "status", "id", **FAILED_ONLY),
)

outbox_history = sa.Table(
    "outbox_history",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=False),
    *_message_columns(),
    sa.Column("archived_at", Timestamp, nullable=False),
)

#: The columns an outbox row carries into ``outbox_history`` (all but ``archived_at``).
ARCHIVED_COLUMNS = tuple(c.name for c in outbox_history.columns if c.name != "archived_at")

inbox = sa.Table(
    "inbox_messages",
    metadata,
    sa.Column("consumer", sa.String(128), primary_key=True),
    sa.Column("message_id", sa.String(64), primary_key=True),
    sa.Column("received_at", Timestamp, nullable=False),
    sa.Index(None, "received_at"),  # pruning finds the oldest rows (saga_engine.inbox.prune)
)

inbox_duplicates = sa.Table(
    "inbox_duplicates",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("consumer", sa.String(128), nullable=False),
    sa.Column("message_id", sa.String(64), nullable=False),
    sa.Column("seen_at", Timestamp, nullable=False),
    sa.Index(None, "consumer"),
)

dead_letters = sa.Table(
    "dead_letters",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("consumer", sa.String(128), nullable=False),
    sa.Column("channel", sa.String(255), nullable=False),
    sa.Column("message_id", sa.String(64)),
    sa.Column("message_type", sa.String(128)),
    sa.Column("reason", sa.Text(), nullable=False),
    sa.Column("raw", LongBytes, nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Index(None, "consumer", "created_at"),
    sa.Index(None, "created_at"),  # pruning finds the oldest (saga_engine.deadletter.prune)
)

transport_messages = sa.Table(
    "transport_messages",
    metadata,
    sa.Column("id", BigId, primary_key=True, autoincrement=True),
    sa.Column("channel", sa.String(255), nullable=False),
    sa.Column("partition_key", sa.String(255), nullable=False),
    sa.Column("message_id", sa.String(64), nullable=False),
    sa.Column("body", LongBytes, nullable=False),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("lease_owner", sa.String(64)),
    sa.Column("lease_until", Timestamp),
    sa.Column("deliveries", sa.Integer(), nullable=False, server_default="0"),
    sa.Index(None, "channel", "id"),
    sa.Index(None, "channel", "partition_key", "id"),
)


saga_instances = sa.Table(
    "saga_instances",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("saga_type", sa.String(128), nullable=False),
    sa.Column("definition_version", sa.Integer(), nullable=False),
    sa.Column("state", sa.String(160), nullable=False),
    sa.Column("data", LongText, nullable=False),
    # Optimistic concurrency: every save is UPDATE ... WHERE version = <the version read>.
    sa.Column("version", sa.Integer(), nullable=False),
    # Attempt of the current step or compensation; with the state it names the awaited command.
    sa.Column("attempt", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("command_id", sa.String(64)),
    # Compensatable steps that committed, in order: compensations run over it in reverse.
    sa.Column(
        "completed_steps", sa.Text(), nullable=False
    ),  # no DEFAULT: MySQL refuses one on TEXT
    # Stored deadlines, not timers, so timeouts and retry back-offs survive restarts.
    sa.Column("deadline", Timestamp),
    sa.Column("deadline_kind", sa.String(16)),
    sa.Column("last_error", sa.Text()),
    sa.Column("tenant_id", sa.String(64)),
    sa.Column("created_at", Timestamp, nullable=False),
    sa.Column("updated_at", Timestamp, nullable=False),
    sa.Column("ended_at", Timestamp),
    # The deadlines role asks for passed deadlines several times a second. Partial where the
    # database allows it: most sagas have no deadline and ended ones never do, so the index stays
    # the size of the sagas that wait on a timer, and a step that sets none writes no entry.
    sa.Index(None, "deadline", **WITH_DEADLINE),
    sa.Index(None, "saga_type", "state"),
    # Pruning finds the longest ended (saga_engine.store.prune_ended). Partial where the database
    # allows it: every step's UPDATE changes the state, so it is never a HOT update, and a full
    # index would take an entry for each of them while the saga runs.
    sa.Index(None, "ended_at", **ENDED_ONLY),
)


#: PostgreSQL advisory-lock spaces of the outbox's wake-ups, each lock keyed by the outbox table's
#: oid (:data:`OUTBOX_LOCK_KEY`, as the relays' lead, ``relay.LEAD``). MUTE: held by a relay that
#: passes on a timer of its own under load, so the outbox's writers send it no NOTIFY. WRITERS:
#: held (shared) until its transaction ends by every writer that found the mute held; a relay
#: that stops passing on its timer takes it for a moment to know that every such writer has
#: committed or rolled back (``saga_engine.outbox.pacing.Mute``).
MUTE_LOCK_SPACE = 0x5A6B
WRITERS_LOCK_SPACE = 0x5A6C
#: The second key of those locks, as a relay's session computes it: the outbox table's oid (NULL
#: while the table does not exist). The trigger uses its ``TG_RELID``, the same oid.
OUTBOX_LOCK_KEY = "CAST(CAST(to_regclass('outbox_messages') AS oid) AS int)"


def _notify_trigger(table: str, channel: str) -> list[str]:
    """PostgreSQL DDL: one NOTIFY per inserting statement (the relays' wake-up hint)."""
    return _trigger(table, f"PERFORM pg_notify('{channel}', '');")


def _muted_notify_trigger(table: str, channel: str) -> list[str]:
    """PostgreSQL DDL: :func:`_notify_trigger`, but silent while a relay holds the mute.

    A NOTIFY costs more than the insert it follows: the server serializes the commits of every
    transaction that sent one, and signals every listener. The mute is read with a lock taken and
    released at once, never waited for. A writer that finds it held takes the writers' lock
    (shared: it waits only while a relay holds it alone, for the length of one statement) and
    reads the mute again, so that the relay, once it lets go, waits for every writer that stayed
    silent; a writer that finds the mute free takes nothing more.
    """
    key = "TG_RELID::int"
    free = f"pg_try_advisory_lock_shared({MUTE_LOCK_SPACE}, {key})"
    return _trigger(
        table,
        f"IF NOT {free} THEN "
        f"PERFORM pg_advisory_xact_lock_shared({WRITERS_LOCK_SPACE}, {key}); "
        f"IF NOT {free} THEN RETURN NULL; END IF; END IF; "
        f"PERFORM pg_advisory_unlock_shared({MUTE_LOCK_SPACE}, {key}); "
        f"PERFORM pg_notify('{channel}', '');",
    )


def _trigger(table: str, body: str) -> list[str]:
    """PostgreSQL DDL: run ``body`` once per statement that inserts into ``table``."""
    function = f"{table}_notify"
    return [
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN {body} RETURN NULL; END $$",
        f"CREATE TRIGGER {table}_notify AFTER INSERT ON {table} "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {function}()",
    ]


#: Extra DDL per dialect that Core cannot express; the migrations run the same statements.
POSTGRES_TRIGGERS = {
    "outbox_messages": _muted_notify_trigger("outbox_messages", "saga_engine_outbox"),
    "transport_messages": _notify_trigger("transport_messages", "saga_engine_transport"),
}

for _name, _statements in POSTGRES_TRIGGERS.items():
    for _statement in _statements:
        sa.event.listen(
            metadata.tables[_name],
            "after_create",
            sa.DDL(_statement.replace("%", "%%")).execute_if(  # type: ignore[no-untyped-call]
                dialect="postgresql"
            ),
        )
