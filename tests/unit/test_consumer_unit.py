"""The consuming loop without servers: where its position goes when a commit fails.

The inbox lives in an in-memory SQLite database; the broker is the in-memory transport (a
unit-test double) with a consumer whose first commit fails.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import sqlalchemy as sa
from sqlalchemy import Connection

from saga_engine import errors, schema
from saga_engine.consumer import ConsumerConfig, MessageConsumer
from saga_engine.messages import Envelope
from saga_engine.transport.base import Delivery, OutgoingMessage
from saga_engine.transport.memory import MemoryConsumer, MemoryTransport

CHANNEL = "payments.commands"


class CommitFailsOnceConsumerDouble(MemoryConsumer):
    """A consumer whose first commit fails, as a Kafka commit does during a rebalance after
    which the consumer keeps its partitions and reads on from its position."""

    failures = 1

    def commit(self, deliveries: Sequence[Delivery]) -> None:
        if self.failures:
            self.failures -= 1
            raise errors.TransportError("kafka commit failed: rebalance in progress (double)")
        super().commit(deliveries)


class CommitFailsOnceTransportDouble(MemoryTransport):
    def consumer(self, group: str, channels: Sequence[str]) -> CommitFailsOnceConsumerDouble:
        return CommitFailsOnceConsumerDouble(self, group, list(channels))


def charge(number: int) -> Envelope:
    return Envelope(
        message_type="ChargePayment",
        destination=CHANNEL,
        partition_key="o-1",
        payload={"order_id": "o-1", "number": number},
    )


def test_a_message_to_retry_comes_again_when_the_commit_before_it_fails(
    memory_db: sa.Engine,
) -> None:
    first, flaky, last = charge(1), charge(2), charge(3)
    calls: list[str] = []

    def handler(conn: Connection, env: Envelope) -> None:
        calls.append(env.message_id)
        if env.message_id == flaky.message_id and calls.count(flaky.message_id) <= 2:
            raise ConnectionResetError("the card service hung up")

    transport = CommitFailsOnceTransportDouble()
    config = ConsumerConfig(poll_timeout=0.01, retry_delay=0.0, max_attempts=3)
    consumer = MessageConsumer("billing", memory_db, transport, [CHANNEL], handler, config=config)
    wire = [
        OutgoingMessage(e.message_id, CHANNEL, "o-1", e.to_wire()) for e in (first, flaky, last)
    ]
    assert all(r.ok for r in transport.publish(wire, 5.0))
    try:
        # The batch fails at the flaky message, which then fails alone as well: the message
        # before it is applied, the flaky one is to be retried, and committing the offsets fails.
        with pytest.raises(errors.TransportError):
            consumer.run_once()
        while consumer.run_once():
            pass
    finally:
        consumer.close()

    with memory_db.connect() as conn:
        applied = set(conn.scalars(sa.select(schema.inbox.c.message_id)))  # committed ones only
    assert applied == {first.message_id, flaky.message_id, last.message_id}
    assert calls.count(flaky.message_id) == 3
