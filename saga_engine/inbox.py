"""Idempotent consumption: the inbox (the article's §3.4, first and third options).

:class:`Inbox` records ``(consumer, message_id)`` under a unique key in the same transaction as
the handler's effects. If the key exists the message was processed before: the handler is skipped
and the duplicate is counted (``inbox_duplicates``). Because the record commits with the effects,
a crash either keeps both or neither; this is exactly-once in effect on top of at-least-once delivery.

:class:`RedisDedupe` is the article's third option, SET NX with a TTL. It is weaker and documented as
such: the key lives outside the database transaction, so a crash between SET NX and the commit
loses the effect unless the key is removed (we remove it on rollback, best effort), and a Redis
failover or an expired TTL lets a duplicate through. Use it in front of naturally idempotent work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy import Connection

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
        rows = [{"consumer": consumer, "message_id": m, "received_at": now} for m in distinct]
        new = set(db.insert_new(conn, schema.inbox, rows, _KEY))
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
