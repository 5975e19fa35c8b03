"""How a relay takes a batch of outbox rows for itself: the claim strategies.

``SkipLockedClaim`` (PostgreSQL, MariaDB >= 10.6, MySQL 8): one transaction locks a batch with
``FOR UPDATE SKIP LOCKED``, publishes it and marks it. Other relays skip the locked rows instead of
waiting; a relay that dies mid-batch releases its locks with its connection, so every row it held is
still PENDING and is published again.

``OptimisticClaim`` (MySQL 5.7 and other servers without SKIP LOCKED; SQLite): the article's
``UPDATE ... WHERE id IN (...) AND status = PENDING`` with a lease, where the rows the UPDATE changed
decide who owns what. No transaction stays open while publishing; a dead relay's lease runs out.

Both apply the same **order guard**: a claimed row is published only if every earlier unsent row of
its partition key is in the same claim (on PostgreSQL the SKIP LOCKED claim carries it in its own
statement, ``guarded_claim``). An earlier row that another relay holds, or that waits in
retry backoff, is still PENDING in the table, so it blocks every later row of its key. Hence a later
message of a key is never published before an earlier one (see docs/outbox.md, "Why order holds").

Every statement of a pass is built once, at import, with bind parameters (see ``Statements``):
building and compiling them anew costs more client CPU than the database spends running them.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, NamedTuple

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


class OutboxRow(NamedTuple):
    """A claimed row: ``ROW_COLUMNS``, in that order.

    Claims hand these out instead of ``sa.Row``: a relay reads a few fields of every row several
    times per pass, and a named tuple's field costs a tenth of a ``Row`` attribute lookup.
    """

    id: int
    message_id: str
    message_type: str
    destination: str
    partition_key: str
    aggregate_type: str
    aggregate_id: str
    correlation_id: str | None
    causation_id: str | None
    tenant_id: str | None
    headers: str
    payload: str
    retry_count: int
    created_at: datetime


def outbox_row(row: OutboxRow | sa.Row[*tuple[Any, ...]]) -> OutboxRow:
    """``row`` (an :class:`OutboxRow`, or any result row with the outbox's column names)."""
    if type(row) is OutboxRow:
        return row
    if tuple(row._fields) == OutboxRow._fields:  # a row of ROW_COLUMNS: the same positions
        return OutboxRow._make(row)
    return OutboxRow._make(getattr(row, name) for name in OutboxRow._fields)


def _outbox_rows(result: sa.Result[Any]) -> list[OutboxRow]:
    # Fetched at once and mapped: a quarter less client CPU than iterating the result row by row.
    return list(map(OutboxRow._make, result.all()))


def status_literal(status: schema.OutboxStatus) -> sa.ColumnElement[int]:
    """``status`` as a literal in the SQL text, not a parameter.

    A prepared statement's generic plan (psycopg prepares a statement on its fifth execution)
    could not otherwise use the partial indexes of PENDING rows, whose predicate is this literal.
    """
    return sa.literal_column(str(int(status)), sa.SmallInteger())


IS_PENDING = t.c.status == status_literal(PENDING)

_NOW = sa.bindparam("now", type_=t.c.next_retry_at.type)
_LIMIT = sa.bindparam("limit", type_=sa.Integer())
_TOKEN = sa.bindparam("token", type_=t.c.claimed_by.type)
_LEASE_UNTIL = sa.bindparam("new_lease_until", type_=t.c.lease_until.type)


def not_behind_backoff(
    now: datetime | sa.BindParameter[datetime], *, row_compare: bool = False
) -> sa.ColumnElement[bool]:
    """The row's key has no row waiting in retry backoff.

    Rows queued behind a failed message could only be held back by the order guard, yet they come
    first by id: a few hundred of them would fill every batch and starve all other keys until it
    succeeds. Normally the row in backoff is its key's earliest unsent one (the guard saw to it),
    so the whole key waits. Uncorrelated on purpose: PostgreSQL hashes this NOT IN, where a
    correlated NOT EXISTS was planned as a nested loop, quadratic on a table without statistics.

    With ``row_compare`` (PostgreSQL) the lookup says ``(status, next_retry_at) > (0, now)``.
    PostgreSQL leaves ``status = 0`` out of the index condition, because the partial index's
    predicate already implies it; ``next_retry_at > now`` alone does not bound the index's leading
    column, so every claim read the whole index of PENDING rows (2.0 ms per claim with 30,000
    rows pending). The row comparison starts the scan at the first row in backoff (0.55 ms).
    """
    if row_compare:
        later = sa.tuple_(t.c.status, t.c.next_retry_at) > sa.tuple_(status_literal(PENDING), now)
    else:
        later = t.c.next_retry_at > now
    in_backoff = sa.select(t.c.partition_key).where(IS_PENDING, later)
    return t.c.partition_key.not_in(in_backoff)


@dataclasses.dataclass(frozen=True)
class Statements:
    """The claim's statements for one kind of server: PostgreSQL binds id and key lists as arrays.

    Parameters: ``now``, ``limit``, ``ids``, ``keys``, ``max_id``, ``token``, ``new_lease_until``.
    """

    #: SKIP LOCKED: lock the next due rows. The id sort is safe with a locking clause because ids
    #: never change (PostgreSQL warns that ORDER BY + FOR UPDATE may return rows out of order only
    #: when the key is updated).
    claim: sa.Select[Any]
    #: Optimistic: the ids of the next due, unleased rows; then those still free, locked.
    candidates: sa.Select[Any]
    take: sa.Select[Any]
    lease: sa.Update
    #: The earliest PENDING row of each key in ``keys`` that is not one of ``ids``.
    guard: sa.Select[Any]
    lock: sa.Select[Any]
    release: sa.Update
    #: PostgreSQL: ``claim`` and ``guard`` in one statement (:func:`guarded_claim`).
    guarded_claim: sa.Select[Any] | None = None

    @classmethod
    def build(cls, *, array: bool) -> Statements:
        free = sa.or_(t.c.lease_until.is_(None), t.c.lease_until < _NOW)
        due = (IS_PENDING, t.c.next_retry_at <= _NOW, not_behind_backoff(_NOW, row_compare=array))
        id_in = db.in_list(t.c.id, "ids", array=array)
        claim = (
            sa.select(*ROW_COLUMNS)
            .where(*due)
            .order_by(t.c.id)
            .limit(_LIMIT)
            .with_for_update(skip_locked=True)
        )
        return cls(
            claim=claim,
            candidates=sa.select(t.c.id).where(*due, free).order_by(t.c.id).limit(_LIMIT),
            take=by_primary_key(
                sa.select(*ROW_COLUMNS)
                .where(id_in, IS_PENDING, free)
                .order_by(t.c.id)
                .with_for_update()
            ),
            lease=update_by_primary_key(
                sa.update(t).where(id_in).values(claimed_by=_TOKEN, lease_until=_LEASE_UNTIL)
            ),
            guard=blockers(
                t,
                db.in_list(t.c.partition_key, "keys", array=array),
                below=sa.bindparam("max_id", type_=t.c.id.type),
                unclaimed=sa.not_(id_in),
            ),
            lock=by_primary_key(sa.select(t.c.id).where(id_in).order_by(t.c.id).with_for_update()),
            release=update_by_primary_key(
                sa.update(t)
                .where(id_in, t.c.claimed_by == _TOKEN)
                .values(claimed_by=sa.null(), lease_until=sa.null())
            ),
            guarded_claim=guarded_claim(claim) if array else None,
        )


def guarded_claim(claim: sa.Select[Any]) -> sa.Select[Any]:
    """PostgreSQL: the SKIP LOCKED ``claim`` and the order guard in one statement, which returns
    only the claimed rows that may be published now.

    One round trip fewer per pass than a claim and then :func:`order_guard`, each with its share
    of client and server CPU, which at a steady rate (a few rows per pass) is most of what a pass
    costs: in ``bench pass``, alternated, a one-row pass took 0.75-0.83 ms of the relay's CPU
    against 0.97-1.11, and a 15-row pass 1.03-1.08 against 1.16-1.30.

    The guard is :func:`order_guard`'s, its lists taken from the claim on the server: for each
    key among the claimed rows, the earliest PENDING row that the claim does not hold; claimed
    rows after it stay behind. Both parts are ``MATERIALIZED``, computed once: the claimed rows
    are read, and locked, once, and those held back stay locked until the commit.

    One statement reads one snapshot: the claimed rows and every earlier row of their keys are
    seen as of the same moment, so with writers that serialise a key's writes an earlier row of a
    claimed row is always visible to the guard (the guard must never read an older snapshot than
    the claim's). A row that another relay delivers after that moment still counts as PENDING; it
    only holds this pass's later rows of its key back, to the next pass.
    """
    claimed = claim.cte("claimed").prefix_with("MATERIALIZED")
    claimed_keys = sa.func.array(sa.select(claimed.c.partition_key).scalar_subquery())
    earlier = t.alias("earlier")
    first = (
        blockers(
            earlier,
            earlier.c.partition_key == sa.any_(claimed_keys),
            below=sa.select(sa.func.max(claimed.c.id)).scalar_subquery(),
            unclaimed=earlier.c.id.not_in(sa.select(claimed.c.id)),
        )
        .cte("blockers")
        .prefix_with("MATERIALIZED")
    )
    by_key = claimed.outerjoin(first, first.c.partition_key == claimed.c.partition_key)
    return (
        sa.select(*claimed.c)
        .select_from(by_key)
        .where(sa.or_(first.c.blocker.is_(None), claimed.c.id < first.c.blocker))
        .order_by(claimed.c.id)
    )


def blockers(
    table: sa.FromClause,
    of_keys: sa.ColumnElement[bool],
    *,
    below: sa.ColumnElement[Any],
    unclaimed: sa.ColumnElement[bool],
) -> sa.Select[Any]:
    """The order guard's lookup in ``table`` (the outbox, or an alias of it): for each key
    ``of_keys`` admits, the earliest PENDING row below the claim's highest id that ``unclaimed``
    says the claim does not hold (``partition_key``, ``blocker``). Claimed rows of that key after
    it must wait."""
    c = table.c
    return (
        sa.select(c.partition_key, sa.func.min(c.id).label("blocker"))
        .where(c.status == status_literal(PENDING), of_keys, c.id < below, unclaimed)
        .group_by(c.partition_key)
    )


#: SQLAlchemy's names for MySQL and MariaDB, for hints only they understand.
_MYSQL = ("mysql", "mariadb")


def by_primary_key(select: sa.Select[Any]) -> sa.Select[Any]:
    """``select``, told to read (and so lock) rows through the primary key on MySQL/MariaDB.

    InnoDB locks every index record a locking read scans. Left to itself, it may find the rows of
    ``id IN (...) AND status = 0`` through an index that leads with ``status`` (the ``(status,
    sent_at)`` index of that time), locking those entries in that index's order, while a relay
    marking its batch holds the rows' primary records and needs the same entries to change them:
    a deadlock (seen with four optimistic relays). Through the primary key every transaction locks
    in id order, as ``lock_in_id_order`` intends.
    """
    for dialect in _MYSQL:
        select = select.with_hint(t, "FORCE INDEX (PRIMARY)", dialect_name=dialect)
    return select


def update_by_primary_key(update: sa.Update) -> sa.Update:
    """``update`` of rows by id, told to find them through the primary key on MySQL/MariaDB.

    Their planner may take the plain index on ``id`` that stands in there for PostgreSQL's partial
    index of PENDING rows (``ix_outbox_messages_pending_id``), or, while the statistics say the
    outbox is nearly empty (it often is), scan the whole table. Under REPEATABLE READ (the
    optimistic claim's) either locks rows other relays hold, or the gaps around them: the lease of
    four optimistic relays deadlocked on MariaDB once their relays archived.
    """
    for dialect in _MYSQL:
        update = update.with_hint("FORCE INDEX (PRIMARY)", dialect_name=dialect)
    return update


def delete_by_primary_key(*, owned: bool) -> sa.Delete:
    """``DELETE`` of the outbox row ``:id`` (if it is still leased to ``:token``, when
    ``owned``), for MySQL and MariaDB: run once per row by :func:`delete_rows`."""
    return _DELETE_ONE[owned]


def delete_rows(conn: Connection, row_ids: Sequence[int], token: str | None = None) -> int:
    """Delete the outbox rows ``row_ids`` (those still leased to ``token``, if one is given) one
    statement per row, by primary key, as an executemany: for MySQL and MariaDB. How many went.

    A DELETE waits for the lock of every row it reads, even under READ COMMITTED (an UPDATE reads
    past a locked row that does not match). A DELETE of a list of ids read more than its rows:
    through the non-unique index on ``id`` it read the entry after each id, and with ``FORCE
    INDEX (PRIMARY)`` (the multi-table form, the only DELETE that takes a hint), while the
    statistics said the outbox was empty, it scanned the primary key. Either way it waited for a
    row another relay had claimed while that relay waited for one of ours: four relays archiving
    on MariaDB deadlocked in every run. A DELETE by primary key equality reads its row alone,
    whatever the statistics say.
    """
    rows = [{"id": row_id, "token": token} for row_id in row_ids]
    return conn.execute(_DELETE_ONE[token is not None], rows).rowcount


#: A construct, not text: a connection's ``schema_translate_map`` names the table it deletes from.
_DELETE_ONE = {
    owned: sa.delete(t).where(
        t.c.id == sa.bindparam("id", type_=t.c.id.type),
        *([t.c.claimed_by == sa.bindparam("token", type_=t.c.claimed_by.type)] if owned else []),
    )
    for owned in (False, True)
}


_ARRAY_STATEMENTS = Statements.build(array=True)
_LIST_STATEMENTS = Statements.build(array=False)


def statements(conn: Connection) -> Statements:
    return _ARRAY_STATEMENTS if db.uses_arrays(conn.dialect) else _LIST_STATEMENTS


@dataclasses.dataclass
class Claim:
    """A batch a relay owns: ``rows`` to publish, and the connection in which to mark them.

    ``token`` is set for leased claims: marks then apply only to rows the lease still covers.
    """

    conn: Connection
    rows: list[OutboxRow]
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
            stmts = statements(conn)
            params = {"now": now, "limit": limit}
            if stmts.guarded_claim is not None:
                publishable = _outbox_rows(conn.execute(stmts.guarded_claim, params))
            else:
                if db.dialect_name(conn) == "mysql":
                    # REPEATABLE READ would let the guard read a snapshot older than the locks.
                    conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                publishable = order_guard(conn, _outbox_rows(conn.execute(stmts.claim, params)))
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

    def _take(self, conn: Connection, token: str, limit: int, now: datetime) -> list[OutboxRow]:
        stmts = statements(conn)
        candidates = conn.scalars(stmts.candidates, {"now": now, "limit": limit}).all()
        if not candidates:
            return []
        # The article's optimistic lock: only rows still PENDING and unleased change hands; a row
        # another relay took since the SELECT is simply not ours. The rows are locked in id order
        # before they are changed: an UPDATE ... IN locks in scan order (physical order on
        # PostgreSQL), so two claims, or a claim and another relay's marks, could each hold a row
        # the other waits for, a deadlock. See also ``lock_in_id_order``.
        rows = _outbox_rows(conn.execute(stmts.take, {"ids": list(candidates), "now": now}))
        if rows:
            conn.execute(
                stmts.lease,
                {
                    "ids": [row.id for row in rows],
                    "token": token,
                    "new_lease_until": now + self.lease,
                },
            )
        return rows


def lock_in_id_order(conn: Connection, row_ids: Sequence[int]) -> None:
    """Lock outbox rows in id order before a transaction changes several of them.

    Every such transaction (claims, and the marks of a leased batch) locks in the same order, so
    none can hold one row while waiting for another that a second one holds. SQLite has no row
    locks (one writer at a time) and ignores this.
    """
    conn.execute(statements(conn).lock, {"ids": list(row_ids)}).all()


def release(conn: Connection, row_ids: Sequence[int], token: str) -> None:
    """Give leased rows back without publishing them."""
    conn.execute(statements(conn).release, {"ids": list(row_ids), "token": token})


#: Set by the order guard, where it is a statement of its own (the optimistic claim on
#: PostgreSQL), for the rest of its transaction. psycopg prepares a statement on its fifth
#: execution, and PostgreSQL then plans it once for any parameters: a generic plan cannot hash
#: the ids of ``id <> ALL(:ids)`` (it hashes constant arrays only) and compares each row with
#: every id, so the guard of a 500-row batch took 4 ms of server CPU instead of 0.8. That cost
#: grows with the square of the batch, while the extra round trip and the planning cost the same
#: for any batch: a claim of a few rows (the usual one at a steady rate, where delivery latency
#: counts) does better without. Hence the threshold.
CUSTOM_PLANS = "SET LOCAL plan_cache_mode = force_custom_plan"
CUSTOM_PLANS_FROM = 100
#: Set in a connection's ``info`` when its whole session plans every statement anew (a relay's
#: own pool: ``relay.relay_engine``), so the guard needs no ``SET LOCAL`` round trip.
PLANS_EACH_EXECUTION = "saga_engine.plans_each_execution"


def order_guard(conn: Connection, rows: Sequence[Any]) -> list[Any]:
    """The rows that may be published now without overtaking an earlier message of their key.

    For each key among ``rows``, find the earliest PENDING row of that key that is not in ``rows``
    (held by another relay, or in retry backoff). Rows of the key after it must wait.
    """
    if not rows:
        return []
    claimed = [row.id for row in rows]
    keys = list(dict.fromkeys(row.partition_key for row in rows))
    params = {"keys": keys, "ids": claimed, "max_id": max(claimed)}
    large = len(rows) >= CUSTOM_PLANS_FROM
    if large and db.uses_arrays(conn.dialect) and not conn.info.get(PLANS_EACH_EXECUTION):
        conn.exec_driver_sql(CUSTOM_PLANS)
    blockers: dict[str, int] = dict(conn.execute(statements(conn).guard, params).all())
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
    version = db.server_version(engine)
    if dialect.name == "postgresql":
        return version >= (9, 5)
    if getattr(dialect, "is_mariadb", False):
        return version >= (10, 6)
    return version >= (8, 0)
