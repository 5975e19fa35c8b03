"""Writes messages into the outbox inside the caller's own transaction.

This is the whole point of the pattern: the business rows and the messages they imply are one
local transaction, so they commit or roll back together. The writer never commits.

Its cost is added to every business transaction that sends a message, so the path is kept short:
the insert is built once, and on PostgreSQL and MySQL it goes to the driver as precompiled SQL
(see ``db.DriverStatement``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from saga_engine import clock, db, errors, schema
from saga_engine.messages import Envelope

t = schema.outbox

#: Built once: constructing the statement per call costs as much as the insert on a fast path.
#: ``inline``: no ``RETURNING id``, which PostgreSQL would otherwise send back for every
#: single-row insert and which the writer never reads. The orchestrator builds a saga's start on it.
INSERT = t.insert().inline()

#: The columns every row sets, in the order of the table: the keys of the writer's rows.
COLUMNS = (
    "message_id",
    "aggregate_type",
    "aggregate_id",
    "message_type",
    "destination",
    "partition_key",
    "correlation_id",
    "causation_id",
    "tenant_id",
    "headers",
    "payload",
    "status",
    "retry_count",
    "next_retry_at",
    "created_at",
    "updated_at",
)
_DRIVER_INSERT = db.DriverStatement(INSERT, COLUMNS, arrays=db.ArrayRows.insert(t, COLUMNS))

#: ``json.dumps(..., separators=(",", ":"), ensure_ascii=False)`` and the same with ASCII:
#: ``json.dumps`` with options builds a new encoder on every call.
_PAYLOAD_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)
_HEADERS_JSON = json.JSONEncoder(separators=(",", ":"))

#: A plain int: drivers handed the row directly need not know the enum.
_PENDING = int(schema.OutboxStatus.PENDING)

#: Kafka's default ``message.max.bytes``: a larger payload could never be delivered.
DEFAULT_MAX_PAYLOAD_BYTES = 1_048_576


class OutboxWriter:
    """Adds envelopes to the outbox of the transaction it is given."""

    def __init__(
        self,
        *,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        clock: clock.Clock = clock.SYSTEM,
    ) -> None:
        self.max_payload_bytes = max_payload_bytes
        self.clock = clock

    def add(self, tx: Session | Connection, envelope: Envelope) -> None:
        """Add one message to ``tx``'s outbox."""
        self.add_many(tx, (envelope,))

    def add_many(self, tx: Session | Connection, envelopes: Iterable[Envelope]) -> None:
        """Add several messages with one insert (see ``db.ArrayRows``; an executemany off
        PostgreSQL)."""
        now = self.clock.now()
        self._insert(tx, [self._row(envelope, now) for envelope in envelopes])

    def pending(self) -> PendingMessages:
        """An empty list of messages to add later, all with one insert (see PendingMessages)."""
        return PendingMessages(self)

    def _insert(self, tx: Session | Connection, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        _DRIVER_INSERT.execute(db.connection_of(tx), rows)

    def _row(self, envelope: Envelope, now: datetime) -> dict[str, Any]:
        payload = _PAYLOAD_JSON.encode(envelope.payload)
        # Text of ASCII only is as many bytes as characters: no need to encode it to count them.
        size = len(payload) if payload.isascii() else len(payload.encode())
        if size > self.max_payload_bytes:
            raise errors.PayloadTooLarge(
                f"payload of {envelope.message_type} {envelope.message_id} is {size} bytes, "
                f"over the {self.max_payload_bytes}-byte limit; send a reference instead"
            )
        headers = envelope.headers
        return {
            "message_id": envelope.message_id,
            "aggregate_type": envelope.aggregate_type,
            "aggregate_id": envelope.aggregate_id,
            "message_type": envelope.message_type,
            "destination": envelope.destination,
            "partition_key": envelope.partition_key,
            "correlation_id": envelope.correlation_id,
            "causation_id": envelope.causation_id,
            "tenant_id": envelope.tenant_id,
            "headers": _HEADERS_JSON.encode(headers) if headers else "{}",
            "payload": payload,
            "status": _PENDING,
            "retry_count": 0,
            "next_retry_at": now,
            "created_at": now,
            "updated_at": now,
        }


class PendingMessages:
    """Messages checked and turned into outbox rows now, inserted later with one statement.

    The engine's consumers collect the messages a whole batch sends (an orchestrator's commands, a
    participant's replies) and write them just before the batch commits: one call and one round
    trip instead of one per message (on PostgreSQL one statement of arrays, else pipelined). Each
    row is built when it is added, so a payload over the limit fails the message that sent it.
    Rows keep the order they were added in.
    """

    def __init__(self, writer: OutboxWriter) -> None:
        self.writer = writer
        self.rows: list[dict[str, Any]] = []

    def add(self, envelope: Envelope) -> None:
        self.rows.append(self.writer._row(envelope, self.writer.clock.now()))

    def write(self, tx: Session | Connection) -> None:
        """Insert the rows in ``tx``'s transaction (the caller commits it), and forget them."""
        self.writer._insert(tx, self.rows)
        self.rows = []
