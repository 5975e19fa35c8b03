"""An in-process transport: a unit-test double, not for production (nothing survives the process).

Each channel is a list of messages; each consumer group has its own read position per channel and
sees every message from the start, like a Kafka topic with one partition.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence

from saga_engine.transport.base import Consumer, Delivery, OutgoingMessage, PublishResult, Transport


class MemoryTransport(Transport):
    name = "memory"
    atomic_publish = True  # all or nothing, as for the SQL transport

    def __init__(self) -> None:
        self.channels: dict[str, list[OutgoingMessage]] = defaultdict(list)
        self.positions: dict[tuple[str, str], int] = defaultdict(int)
        self.lock = threading.Lock()
        self.down = False  # tests set this to simulate an outage

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        if self.down:
            return [
                PublishResult(m.message_id, "memory transport is down", unreachable=True)
                for m in messages
            ]
        with self.lock:
            for message in messages:
                self.channels[message.destination].append(message)
        return [PublishResult(m.message_id) for m in messages]

    def consumer(self, group: str, channels: Sequence[str]) -> MemoryConsumer:
        return MemoryConsumer(self, group, list(channels))


class MemoryConsumer(Consumer):
    def __init__(self, transport: MemoryTransport, group: str, channels: list[str]) -> None:
        self.transport = transport
        self.group = group
        self.channels = channels
        self.read: dict[str, int] = {}

    def poll(self, max_messages: int, timeout: float) -> list[Delivery]:
        out: list[Delivery] = []
        with self.transport.lock:
            for channel in self.channels:
                start = self.read.get(channel, self.transport.positions[(self.group, channel)])
                pending = self.transport.channels[channel][start : start + max_messages - len(out)]
                for offset, message in enumerate(pending, start):
                    out.append(
                        Delivery(
                            channel, message.partition_key, message.value, token=(channel, offset)
                        )
                    )
                self.read[channel] = start + len(pending)
        return out

    def commit(self, deliveries: Sequence[Delivery]) -> None:
        with self.transport.lock:
            for delivery in deliveries:
                channel, offset = _position(delivery)
                key = (self.group, channel)
                self.transport.positions[key] = max(self.transport.positions[key], offset + 1)

    def release(self, deliveries: Sequence[Delivery]) -> None:
        for delivery in deliveries:
            channel, offset = _position(delivery)
            self.read[channel] = min(self.read.get(channel, offset), offset)

    def close(self) -> None:
        self.read.clear()


def _position(delivery: Delivery) -> tuple[str, int]:
    token: tuple[str, int] = delivery.token  # type: ignore[assignment]
    return token
