"""The port every broker adapter implements.

A transport does two things: publish a batch of messages with a precise result for each (the relay
marks exactly the acknowledged ones), and hand out consumers that deliver messages of some channels
to one consumer group, at least once, with per-partition-key order, committing only when told to.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """What the relay hands to a transport: routing plus the encoded envelope."""

    message_id: str
    destination: str
    partition_key: str
    value: bytes
    headers: tuple[tuple[str, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class PublishResult:
    """The outcome for one message: ``error`` is None when the broker acknowledged it."""

    message_id: str
    error: str | None = None
    #: The broker could not be reached or did not answer in time: not this message's fault, so
    #: the relay retries it without spending its retry budget (an outage never makes it FAILED).
    unreachable: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message received by a consumer. ``token`` is what ``commit`` needs to acknowledge it."""

    channel: str
    partition_key: str
    value: bytes
    token: object = field(compare=False)


class Consumer(abc.ABC):
    """Receives messages of some channels for one consumer group."""

    @abc.abstractmethod
    def poll(self, max_messages: int, timeout: float) -> list[Delivery]:
        """Up to ``max_messages`` deliveries, waiting at most ``timeout`` seconds for the first."""

    @abc.abstractmethod
    def commit(self, deliveries: Sequence[Delivery]) -> None:
        """Acknowledge ``deliveries``; call only after their effects are committed locally."""

    def release(self, deliveries: Sequence[Delivery]) -> None:  # noqa: B027 - optional hook
        """Give ``deliveries`` back undelivered so they come again (by default: after a lease)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the group and free resources."""

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Transport(abc.ABC):
    """A broker: publishes batches and creates consumers."""

    #: URL scheme, for messages and status output.
    name: str = "transport"
    #: True if, within one publish call, all messages of a partition key are acknowledged
    #: together or not at all (a table insert is; so is a Kafka record batch per partition). The
    #: relay then sends a batch in one call instead of in per-key waves.
    atomic_publish: bool = False

    @abc.abstractmethod
    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        """Publish ``messages`` and wait up to ``timeout`` seconds for each acknowledgement.

        Returns one result per message, in the same order. Never raises for a broker problem: a
        message that was not acknowledged gets a result with its error, so the caller can retry
        exactly those.
        """

    @abc.abstractmethod
    def consumer(self, group: str, channels: Sequence[str]) -> Consumer:
        """A consumer in ``group`` for ``channels``."""

    def ensure_channels(self, channels: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Create the channels (topics) if the broker needs them created up front."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
