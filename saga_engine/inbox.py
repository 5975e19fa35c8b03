"""Idempotent consumption: the inbox (the article's §3.4, first and third options).

:class:`Inbox` records ``(consumer, message_id)`` under a unique key in the same transaction as
the handler's effects. If the key exists the message was processed before: the handler is skipped
and the duplicate is counted (``inbox_duplicates``). Because the record commits with the effects,
a crash either keeps both or neither; this is exactly-once in effect on top of at-least-once delivery.

:class:`RedisDedupe` is the article's third option, SET NX with a TTL. It is weaker and documented as
such: the key lives outside the database transaction, so a crash between SET NX and the commit
loses the effect unless the key is removed (we remove it on rollback, best effort), and a Redis
failover or an expired TTL lets a duplicate through. Use it in front of naturally idempotent work.

:func:`prune` deletes inbox entries older than a retention (30 days by default), in short
batches; the worker's ``cleanup`` role and ``saga-engine cleanup`` run it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from saga_engine import clock, db, schema

#: Built once: constructing a statement per call costs as much client CPU as executing it.
_RECORD_DUPLICATE = schema.inbox_duplicates.insert()
_KEY = schema.inbox.c.message_id


class Inbox:
    """The unique-index inbox."""

    def __init__(self, clock: clock.Clock = clock.SYSTEM) -> None:
        self.clock = clock

    def first_time(self, conn: Connection, consumer: str, message_id: str) -> bool:
        """Record the message for ``consumer``; False (and counted) if it was recorded before."""
        return self.first_times(conn, consumer, [message_id])[0]

    def first_times(
        self, conn: Connection, consumer: str, message_ids: Sequence[str]
    ) -> list[bool]:
        """Record a batch of messages for ``consumer`` in one statement where the database allows.

        One flag per id, in order: True where the id is new. An id that comes twice in the batch is
        new at its first place only, as if the messages had been recorded one by one. The
        duplicates are counted (``inbox_duplicates``).
        """
        now = self.clock.now()
        # Sorted, so that two transactions recording overlapping batches take the unique index's
        # locks in the same order and cannot deadlock on each other.
        distinct = sorted(set(message_ids))
        constants = {"consumer": consumer, "received_at": now}
        new = set(db.insert_new_keys(conn, schema.inbox, _KEY, distinct, constants))
        flags = []
        for message_id in message_ids:
            flags.append(message_id in new)
            new.discard(message_id)  # a second occurrence in the batch is a duplicate
        duplicates = [
            {"consumer": consumer, "message_id": m, "seen_at": now}
            for m, first in zip(message_ids, flags, strict=True)
            if not first
        ]
        if duplicates:
            conn.execute(_RECORD_DUPLICATE, duplicates)
        return flags

    def duplicates(self, conn: Connection, consumer: str | None = None) -> int:
        stmt = sa.select(sa.func.count()).select_from(schema.inbox_duplicates)
        if consumer is not None:
            stmt = stmt.where(schema.inbox_duplicates.c.consumer == consumer)
        return int(conn.scalar(stmt) or 0)


#: How long the worker's cleanup keeps inbox entries unless told otherwise. A message can come
#: back as long as the broker keeps it (a consumer group reset to the earliest offset replays the
#: whole log; Kafka keeps 7 days by default), so keep entries longer than any log you may replay.
INBOX_RETENTION = timedelta(days=30)


@dataclasses.dataclass(frozen=True)
class PruneResult:
    inbox: int  # inbox_messages rows deleted
    duplicates: int  # inbox_duplicates rows deleted
    batches: int


def prune(
    engine: Engine,
    *,
    retention: timedelta = INBOX_RETENTION,
    batch_size: int = 1000,
    clock: clock.Clock = clock.SYSTEM,
    max_batches: int | None = None,
) -> PruneResult:
    """Delete inbox entries received, and duplicates counted, more than ``retention`` ago.

    ``batch_size`` rows at a time, each batch its own short transaction, like the outbox's
    cleanup. A pruned message that is delivered again is processed again: that is why the
    retention must outlast every redelivery (see ``INBOX_RETENTION``).
    """
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    if retention <= timedelta(0):
        raise ValueError("retention must be positive: a zero retention would disable the inbox")
    cutoff = clock.now() - retention
    i, d = schema.inbox, schema.inbox_duplicates
    inbox_keys = (
        sa.select(i.c.consumer, i.c.message_id)
        .where(i.c.received_at < cutoff)
        .order_by(i.c.received_at)
        .limit(batch_size)
    )
    duplicate_ids = sa.select(d.c.id).where(d.c.seen_at < cutoff).order_by(d.c.id).limit(batch_size)

    def batch(conn: Connection) -> dict[str, int]:
        # Keys first, then DELETE ... IN: DELETE ... LIMIT is MySQL-only.
        keys = [tuple(row) for row in conn.execute(inbox_keys)]
        ids = conn.scalars(duplicate_ids).all()
        pair = sa.tuple_(i.c.consumer, i.c.message_id)
        return {
            "inbox": conn.execute(sa.delete(i).where(pair.in_(keys))).rowcount if keys else 0,
            "duplicates": conn.execute(sa.delete(d).where(d.c.id.in_(ids))).rowcount if ids else 0,
        }

    totals, batches = db.delete_in_batches(engine, batch, max_batches)
    return PruneResult(totals["inbox"], totals["duplicates"], batches)


class RedisClient(Protocol):
    def set(self, name: str, value: str, *, nx: bool, ex: int) -> Any: ...
    def delete(self, *names: str) -> Any: ...
    def incr(self, name: str) -> Any: ...
    def get(self, name: str) -> Any: ...


class RedisDedupe:
    """SET NX + TTL dedupe; weaker than :class:`Inbox` (see the module docstring)."""

    def __init__(
        self,
        client: RedisClient,
        *,
        ttl_seconds: int = 7 * 24 * 3600,
        prefix: str = "saga-engine:dedupe",
    ) -> None:
        self.client = client
        self.ttl_seconds = ttl_seconds
        self.prefix = prefix

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> RedisDedupe:
        import redis

        return cls(redis.Redis.from_url(url), **kwargs)

    def _key(self, consumer: str, message_id: str) -> str:
        return f"{self.prefix}:{consumer}:{message_id}"

    def _duplicates_key(self, consumer: str) -> str:
        return f"{self.prefix}:duplicates:{consumer}"

    def first_time(self, consumer: str, message_id: str) -> bool:
        if self.client.set(self._key(consumer, message_id), "1", nx=True, ex=self.ttl_seconds):
            return True
        self.client.incr(self._duplicates_key(consumer))
        return False

    def duplicates(self, consumer: str) -> int:
        """How many duplicates ``consumer`` skipped (the counter has no TTL)."""
        return int(self.client.get(self._duplicates_key(consumer)) or 0)

    def forget(self, consumer: str, message_id: str) -> None:
        """Undo :meth:`first_time` after the handler's transaction rolled back."""
        self.client.delete(self._key(consumer, message_id))
