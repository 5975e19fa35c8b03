"""A transport that acknowledges every message at once: the relay measured without a broker.

It is a measuring instrument, not a test double for correctness: with it, a relay's rate is what
the database and the relay's own Python cost allow, which tells how much of the gap between the
raw producer and the relay is the relay's and how much the broker's.
"""

from __future__ import annotations

from collections.abc import Sequence

from saga_engine.transport.base import Consumer, OutgoingMessage, PublishResult, Transport


class NullTransport(Transport):
    name = "null"

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        return [PublishResult(m.message_id) for m in messages]

    def consumer(self, group: str, channels: Sequence[str]) -> Consumer:
        raise NotImplementedError("the null transport delivers nothing")
