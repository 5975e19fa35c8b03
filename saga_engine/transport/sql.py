"""A durable transport through a table of the engine's own database (the embedded default).

Each channel is a queue: a published message is one row of ``transport_messages``; consumers lease
rows (the same optimistic claim the outbox uses), hand them out, and delete them on commit. A
consumer that dies leaves its lease to run out, so its messages come again (at least once). The
order guard keeps per-key order across any number of consumers: a row is handed out only when no earlier
row of the same channel and key is still in the table.

Every consumer of a channel competes for its messages, whatever its group: a channel has one
consuming service here. Fan-out to several services needs one channel each, or Kafka.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, Engine, exc

from saga_engine import clock, ids, schema
from saga_engine.outbox.notify import TRANSPORT_CHANNEL, Wakeup, listen_conninfo
from saga_engine.transport.base import Consumer, Delivery, OutgoingMessage, PublishResult, Transport

q = schema.transport_messages
#: What of a consumer group's name fits in ``lease_owner`` before ``:`` and a 36-character id.
_OWNER_NAME_LENGTH = q.c.lease_owner.type.length - 37  # type: ignore[attr-defined]


class SqlTransport(Transport):
    name = "sql"
    #: A publish is one transaction, all or nothing, so a later message of a key can never be
    #: acknowledged while an earlier one in the same call failed: the relay sends whole batches.
    atomic_publish = True

    def __init__(
        self,
        engine: Engine,
        *,
        lease: timedelta = timedelta(seconds=30),
        idle_poll: float = 0.05,
        clock: clock.Clock = clock.SYSTEM,
        listen: bool = True,
    ) -> None:
        self.engine = engine
        self.listen = listen  # LISTEN for wake-ups on PostgreSQL (off for deterministic tests)
        self.lease = lease
        self.idle_poll = idle_poll
        self.clock = clock

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        if not messages:
            return []
        now = self.clock.now()
        rows = [
            {
                "channel": m.destination,
                "partition_key": m.partition_key,
                "message_id": m.message_id,
                "body": m.value,
                "created_at": now,
            }
            for m in messages
        ]
        try:
            with self.engine.begin() as conn:
                conn.execute(q.insert(), rows)
        except exc.SQLAlchemyError as error:
            reason = f"sql transport: {str(error).strip().splitlines()[0]}"
            return [PublishResult(m.message_id, reason, unreachable=True) for m in messages]
        return [PublishResult(m.message_id) for m in messages]

    def consumer(self, group: str, channels: Sequence[str]) -> SqlConsumer:
        return SqlConsumer(self, group, list(channels))

    def insert_in(self, conn: Connection, messages: Sequence[OutgoingMessage]) -> None:
        """Publish inside an open transaction of the same database (exactly once, no relay hop)."""
        now = self.clock.now()
        conn.execute(
            q.insert(),
            [
                {
                    "channel": m.destination,
                    "partition_key": m.partition_key,
                    "message_id": m.message_id,
                    "body": m.value,
                    "created_at": now,
                }
                for m in messages
            ],
        )


class SqlConsumer(Consumer):
    def __init__(self, transport: SqlTransport, group: str, channels: list[str]) -> None:
        if not channels:
            raise ValueError("a consumer needs at least one channel")
        self.transport = transport
        self.group = group
        self.channels = channels
        self.wakeup = Wakeup(listen_conninfo(transport.engine), TRANSPORT_CHANNEL)
        if transport.listen:
            self.wakeup.start()

    def poll(self, max_messages: int, timeout: float) -> list[Delivery]:
        deadline = time.monotonic() + timeout
        while True:
            deliveries = self._claim(max_messages)
            remaining = deadline - time.monotonic()
            if deliveries or remaining <= 0:
                return deliveries
            self.wakeup.wait(min(self.transport.idle_poll, remaining))

    def _claim(self, limit: int) -> list[Delivery]:
        # Unique by its id; the group's name only tells a reader of the table who holds the lease,
        # so it is cut to fit the column beside the 36-character id.
        token = f"{self.group[:_OWNER_NAME_LENGTH]}:{ids.new_id()}"
        now = self.transport.clock.now()
        free = sa.or_(q.c.lease_until.is_(None), q.c.lease_until < now)
        with self.transport.engine.begin() as conn:
            candidates = conn.scalars(
                sa.select(q.c.id)
                .where(q.c.channel.in_(self.channels), free)
                .order_by(q.c.id)
                .limit(limit)
            ).all()
            if not candidates:
                return []
            # Lock the still-free candidates in id order before leasing them, as the outbox claims
            # do (``claims.lock_in_id_order``): an UPDATE ... IN locks in scan order and two
            # consumers claiming at once could deadlock.
            rows = conn.execute(
                sa.select(q.c.id, q.c.channel, q.c.partition_key, q.c.body)
                .where(q.c.id.in_(candidates), free)
                .order_by(q.c.id)
                .with_for_update()
            ).all()
            if not rows:
                return []
            conn.execute(
                sa.update(q)
                .where(q.c.id.in_([r.id for r in rows]))
                .values(
                    lease_owner=token,
                    lease_until=now + self.transport.lease,
                    deliveries=q.c.deliveries + 1,
                )
            )
            ready = _order_guard(conn, rows)
            ready_ids = {r.id for r in ready}
            _release(conn, [r.id for r in rows if r.id not in ready_ids])
        return [Delivery(r.channel, r.partition_key, bytes(r.body), token=r.id) for r in ready]

    def commit(self, deliveries: Sequence[Delivery]) -> None:
        if deliveries:
            with self.transport.engine.begin() as conn:
                conn.execute(sa.delete(q).where(q.c.id.in_([d.token for d in deliveries])))

    def release(self, deliveries: Sequence[Delivery]) -> None:
        if deliveries:
            with self.transport.engine.begin() as conn:
                _release(conn, [d.token for d in deliveries])

    def close(self) -> None:
        self.wakeup.stop()


def _release(conn: Connection, row_ids: Sequence[Any]) -> None:
    if row_ids:
        conn.execute(
            sa.update(q).where(q.c.id.in_(row_ids)).values(lease_owner=None, lease_until=None)
        )


def _order_guard(conn: Connection, rows: Sequence[Any]) -> list[Any]:
    """Rows with no earlier row of the same channel and key left in the table (but ours)."""
    if not rows:
        return []
    mine = [r.id for r in rows]
    blockers = {
        (channel, key): first
        for channel, key, first in conn.execute(
            sa.select(q.c.channel, q.c.partition_key, sa.func.min(q.c.id))
            .where(
                q.c.partition_key.in_({r.partition_key for r in rows}),
                q.c.id < max(mine),
                q.c.id.not_in(mine),
            )
            .group_by(q.c.channel, q.c.partition_key)
        ).all()
    }
    return [r for r in rows if r.id < blockers.get((r.channel, r.partition_key), r.id + 1)]
