"""Writes messages into the outbox inside the caller's own transaction.

This is the whole point of the pattern: the business rows and the messages they imply are one
local transaction, so they commit or roll back together. The writer never commits.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.orm import Session

from saga_engine import clock, db, errors, schema
from saga_engine.messages import Envelope

#: Built once: constructing the statement per call costs as much as the insert on a fast path.
_INSERT = schema.outbox.insert()

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
        """Add several messages with one executemany insert."""
        now = self.clock.now()
        rows = [self._row(envelope, now) for envelope in envelopes]
        if rows:
            db.connection_of(tx).execute(_INSERT, rows)

    def _row(self, envelope: Envelope, now: Any) -> dict[str, Any]:
        payload = json.dumps(envelope.payload, separators=(",", ":"), ensure_ascii=False)
        size = len(payload.encode())
        if size > self.max_payload_bytes:
            raise errors.PayloadTooLarge(
                f"payload of {envelope.message_type} {envelope.message_id} is {size} bytes, "
                f"over the {self.max_payload_bytes}-byte limit; send a reference instead"
            )
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
            "headers": json.dumps(envelope.headers, separators=(",", ":")),
            "payload": payload,
            "status": schema.OutboxStatus.PENDING,
            "retry_count": 0,
            "next_retry_at": now,
            "created_at": now,
            "updated_at": now,
        }
