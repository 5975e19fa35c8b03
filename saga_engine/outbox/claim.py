"""How a relay takes a batch of outbox rows for itself: the claim strategies.

``SkipLockedClaim`` (PostgreSQL, MariaDB >= 10.6, MySQL 8): one transaction locks a batch with
``FOR UPDATE SKIP LOCKED``, publishes it and marks it. Other relays skip the locked rows instead of
waiting; a relay that dies mid-batch releases its locks with its connection, so every row it held is
still PENDING and is published again.

``OptimisticClaim`` (MySQL 5.7 and other servers without SKIP LOCKED; SQLite): the article's
``UPDATE ... WHERE id IN (...) AND status = PENDING`` with a lease, where the rows the UPDATE changed
decide who owns what. No transaction stays open while publishing; a dead relay's lease runs out.

Both apply the same **order guard**: a claimed row is published only if every earlier unsent row of
its partition key is in the same claim. An earlier row that another relay holds, or that waits in
retry backoff, is still PENDING in the table, so it blocks every later row of its key. Hence a later
message of a key is never published before an earlier one (see docs/outbox.md, "Why order holds").
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from saga_engine import db, ids, schema

t = schema.outbox
PENDING = schema.OutboxStatus.PENDING

#: The columns a relay needs to build the wire message.
ROW_COLUMNS = (
    t.c.id,
    t.c.message_id,
    t.c.message_type,
    t.c.destination,
    t.c.partition_key,
    t.c.aggregate_type,
    t.c.aggregate_id,
    t.c.correlation_id,
    t.c.causation_id,
    t.c.tenant_id,
    t.c.headers,
    t.c.payload,
    t.c.retry_count,
    t.c.created_at,
)


@dataclasses.dataclass
class Claim:
    """A batch a relay owns: ``rows`` to publish, and the connection in which to mark them.

    ``token`` is set for leased claims: marks then apply only to rows the lease still covers.
    """

    conn: Connection
    rows: list[Any]  # sa.Row of ROW_COLUMNS
    token: str | None = None


class ClaimStrategy(abc.ABC):
    name: str

    @abc.abstractmethod
    def claim(
        self, engine: Engine, limit: int, now: datetime
    ) -> contextlib.AbstractContextManager[Claim]:
        """A claim whose connection is in a transaction in which to mark the results."""


class SkipLockedClaim(ClaimStrategy):
    name = "skip_locked"

    @contextlib.contextmanager
    def claim(self, engine: Engine, limit: int, now: datetime) -> Iterator[Claim]:
        with engine.connect() as conn, conn.begin():
            if db.dialect_name(conn) == "mysql":
                # REPEATABLE READ would let the order guard read a snapshot older than the locks.
                conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            # The id sort is safe with a locking clause because ids never change (PostgreSQL warns
            # that ORDER BY + FOR UPDATE may return rows out of order only when the key is updated).
            rows = conn.execute(
                sa.select(*ROW_COLUMNS)
                .where(t.c.status == PENDING, t.c.next_retry_at <= now, not_behind_backoff(now))
                .order_by(t.c.id)
                .limit(limit)
                .with_for_update(skip_locked=True)
            ).all()
            publishable = order_guard(conn, rows)
            yield Claim(conn, publishable)
            # Rows held back by the guard need nothing: their locks end with the transaction.


class OptimisticClaim(ClaimStrategy):
    name = "optimistic"

    def __init__(self, lease: timedelta = timedelta(seconds=30)) -> None:
        self.lease = lease

    @contextlib.contextmanager
    def claim(self, engine: Engine, limit: int, now: datetime) -> Iterator[Claim]:
        token = ids.new_id()
        with engine.begin() as conn:
            rows = self._take(conn, token, limit, now)
            publishable = order_guard(conn, rows)
            kept = {row.id for row in publishable}
            held = [row.id for row in rows if row.id not in kept]
            if held:
                release(conn, held, token)
        with engine.connect() as conn:
            # No transaction is open while the batch is published; the marks commit on their own.
            yield Claim(conn, publishable, token=token)
            conn.commit()

    def _take(self, conn: Connection, token: str, limit: int, now: datetime) -> list[Any]:
        free = sa.or_(t.c.lease_until.is_(None), t.c.lease_until < now)
        candidates = conn.scalars(
            sa.select(t.c.id)
            .where(t.c.status == PENDING, t.c.next_retry_at <= now, free, not_behind_backoff(now))
            .order_by(t.c.id)
            .limit(limit)
        ).all()
        if not candidates:
            return []
        # The article's optimistic lock: only rows still PENDING and unleased change hands; a row
        # another relay took since the SELECT is simply not ours. The rows are locked in id order
        # before they are changed: an UPDATE ... IN locks in scan order (physical order on
        # PostgreSQL), so two claims, or a claim and another relay's marks, could each hold a row
        # the other waits for, a deadlock. See also ``lock_in_id_order``.
        rows = conn.execute(
            sa.select(*ROW_COLUMNS)
            .where(t.c.id.in_(candidates), t.c.status == PENDING, free)
            .order_by(t.c.id)
            .with_for_update()
        ).all()
        if rows:
            conn.execute(
                sa.update(t)
                .where(t.c.id.in_([row.id for row in rows]))
                .values(claimed_by=token, lease_until=now + self.lease)
            )
        return list(rows)


def lock_in_id_order(conn: Connection, row_ids: Sequence[int]) -> None:
    """Lock outbox rows in id order before a transaction changes several of them.

    Every such transaction (claims, and the marks of a leased batch) locks in the same order, so
    none can hold one row while waiting for another that a second one holds. SQLite has no row
    locks (one writer at a time) and ignores this.
    """
    conn.execute(
        sa.select(t.c.id).where(t.c.id.in_(row_ids)).order_by(t.c.id).with_for_update()
    ).all()


def release(conn: Connection, row_ids: Sequence[int], token: str) -> None:
    """Give leased rows back without publishing them."""
    conn.execute(
        sa.update(t)
        .where(t.c.id.in_(row_ids), t.c.claimed_by == token)
        .values(claimed_by=None, lease_until=None)
    )


def not_behind_backoff(now: datetime) -> sa.ColumnElement[bool]:
    """The row's key has no row waiting in retry backoff.

    Rows queued behind a failed message could only be held back by the order guard, yet they come
    first by id: a few hundred of them would fill every batch and starve all other keys until it
    succeeds. Normally the row in backoff is its key's earliest unsent one (the guard saw to it),
    so the whole key waits. Uncorrelated on purpose: PostgreSQL hashes this NOT IN, where a
    correlated NOT EXISTS was planned as a nested loop, quadratic on a table without statistics.
    """
    in_backoff = sa.select(t.c.partition_key).where(t.c.status == PENDING, t.c.next_retry_at > now)
    return t.c.partition_key.not_in(in_backoff)


def order_guard(conn: Connection, rows: Sequence[Any]) -> list[Any]:
    """The rows that may be published now without overtaking an earlier message of their key.

    For each key among ``rows``, find the earliest PENDING row of that key that is not in ``rows``
    (held by another relay, or in retry backoff). Rows of the key after it must wait.
    """
    if not rows:
        return []
    claimed = [row.id for row in rows]
    keys = {row.partition_key for row in rows}
    blockers = dict(
        conn.execute(
            sa.select(t.c.partition_key, sa.func.min(t.c.id))
            .where(
                t.c.status == PENDING,
                t.c.partition_key.in_(keys),
                t.c.id < max(claimed),
                t.c.id.not_in(claimed),
            )
            .group_by(t.c.partition_key)
        ).all()
    )
    if not blockers:
        return list(rows)
    return [row for row in rows if row.id < blockers.get(row.partition_key, row.id + 1)]


def strategy_for(
    engine: Engine, name: str = "auto", lease: timedelta | None = None
) -> ClaimStrategy:
    """The claim strategy ``name``, or for ``auto`` the best one the server supports."""
    if name == "auto":
        name = "skip_locked" if supports_skip_locked(engine) else "optimistic"
    if name == "skip_locked":
        return SkipLockedClaim()
    if name == "optimistic":
        return OptimisticClaim(lease or timedelta(seconds=30))
    raise ValueError(f"unknown claim strategy {name!r}: expected auto, skip_locked or optimistic")


def supports_skip_locked(engine: Engine) -> bool:
    """PostgreSQL >= 9.5, MySQL >= 8.0 and MariaDB >= 10.6 have SKIP LOCKED; SQLite has no row locks."""
    dialect = engine.dialect
    if dialect.name == "sqlite":
        return False
    with engine.connect() as conn:  # server_version_info is known only after a first connect
        conn.execute(sa.text("SELECT 1"))
    version = dialect.server_version_info or (0,)
    if dialect.name == "postgresql":
        return version >= (9, 5)
    if getattr(dialect, "is_mariadb", False):
        return version >= (10, 6)
    return version >= (8, 0)
