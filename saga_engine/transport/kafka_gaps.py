"""Offsets a broker skipped: a Kafka consumer reads such a gap again instead of losing it.

Kafka numbers a partition's records one after another, and the engine's channels hold no
compacted or transactional records, so the offsets a consumer reads follow each other.
kafka-python takes any record at or after the offset it fetched from, so a broker that answers
with a later batch than the one asked for would lose the messages in between without a word.
tansu does that under load: it gives a batch its offsets before it stores it, and a fetch in that
moment gets the next batch already stored. Two producers writing one partition with a consumer
reading along lost 3 of 21,738 messages that way, all of which a group reading afterwards found.

So the consumer remembers, per partition, the offset it expects next (:class:`GapGuard`). When a
poll returns a later one, it delivers the records before the gap and seeks back to the gap, which
the next poll reads again; it fills once the broker has stored its batch. A gap still open after
``patience`` seconds is taken as real (a compacted topic, a transaction's marker, a batch the
broker lost) and logged as a warning, and reading goes on after it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

#: How long a gap is read again before it is taken as real.
PATIENCE_SECONDS = 1.0


class _Record(Protocol):
    @property
    def offset(self) -> int: ...


R = TypeVar("R", bound=_Record)


class GapGuard:
    """The next offset expected of each partition, and what a poll may deliver given it."""

    def __init__(
        self, patience: float = PATIENCE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.patience = patience
        self._clock = clock
        self._next: dict[Any, int] = {}
        #: When the open gap of a partition was first seen.
        self._open_since: dict[Any, float] = {}

    def forget(self, partitions: Iterable[Any]) -> None:
        """Partitions revoked or newly assigned: where they go on from is the group's to say."""
        for partition in partitions:
            self._next.pop(partition, None)
            self._open_since.pop(partition, None)

    def rewound(self, partition: Any, offset: int) -> None:
        """The consumer sought back to ``offset`` (a release): that is the offset expected next."""
        self._next[partition] = offset
        self._open_since.pop(partition, None)

    def take(self, partition: Any, records: Sequence[R]) -> tuple[Sequence[R], int | None]:
        """The records of ``partition`` to deliver, in order, and the offset to seek back to when
        the broker skipped some (None when it did not, or when the gap is taken as real)."""
        expected = self._next.get(partition)
        for index, record in enumerate(records):
            if (
                expected is not None
                and record.offset > expected
                and self._read_again(partition, expected, record.offset)
            ):
                self._next[partition] = expected
                return records[:index], expected
            expected = record.offset + 1
        if expected is not None:
            self._next[partition] = expected
        self._open_since.pop(partition, None)
        return records, None

    def _read_again(self, partition: Any, expected: int, found: int) -> bool:
        now = self._clock()
        since = self._open_since.get(partition)
        if since is None:
            since = self._open_since[partition] = now
            log.info(
                "%s: offsets %d to %d skipped by the broker; reading them again",
                partition,
                expected,
                found - 1,
            )
        if now - since < self.patience:
            return True
        log.warning(
            "%s: offsets %d to %d did not arrive in %.1f s; reading on from %d "
            "(a compacted topic or a transaction leaves such gaps; otherwise the broker lost them)",
            partition,
            expected,
            found - 1,
            self.patience,
            found,
        )
        self._open_since.pop(partition, None)
        return False
