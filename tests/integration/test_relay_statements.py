"""The relay's prebuilt statements on each real database: PostgreSQL binds id and key lists as
arrays, MariaDB and SQLite as ``IN`` lists, and both paths keep the same guarantees.

Statements are observed with a ``before_cursor_execute`` listener, so each test checks both what
was sent and what it did.
"""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from saga_engine import db, schema
from saga_engine.errors import ConfigurationError
from saga_engine.messages import Envelope
from saga_engine.outbox import OutboxWriter, admin
from saga_engine.outbox import claim as claims
from saga_engine.outbox.relay import BatchOutcome, Relay, RelayConfig
from saga_engine.transport.base import Consumer, OutgoingMessage, PublishResult, Transport
from saga_engine.transport.memory import MemoryTransport

t = schema.outbox
PENDING, SENT, FAILED = schema.OutboxStatus
START = datetime(2030, 1, 1, 12, 0, 0, 250000)
LATER = START + timedelta(seconds=1)


class ClockDouble:
    def __init__(self, start: datetime = START) -> None:
        self.current = start

    def now(self) -> datetime:
        return self.current


class StatementLog:
    """Every statement an engine sends, with its parameters."""

    def __init__(self, engine: sa.Engine) -> None:
        self.sent: list[tuple[str, Any]] = []
        sa.event.listen(engine, "before_cursor_execute", self._record)

    def _record(self, _conn: Any, _cursor: Any, sql: str, params: Any, *_: Any) -> None:
        self.sent.append((" ".join(sql.split()), params))

    def matching(self, fragment: str) -> list[tuple[str, Any]]:
        return [(sql, params) for sql, params in self.sent if fragment in sql]


class FailingTransportDouble(Transport):
    """Acknowledges every message but those in ``failing``, one result per message."""

    name = "failing-double"

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        return [
            PublishResult(m.message_id, "rejected" if m.message_id in self.failing else None)
            for m in messages
        ]

    def consumer(self, group: str, channels: Sequence[str]) -> Consumer:
        raise NotImplementedError


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = db.create_engine(db_url, pool_size=4)
    yield engine
    engine.dispose()


def envelope(key: str, n: int = 0, **fields: Any) -> Envelope:
    return Envelope(
        message_type="Tick",
        destination="ticks",
        partition_key=key,
        aggregate_type="Ticker",
        aggregate_id=key,
        payload={"key": key, "n": n},
        **fields,
    )


def write(engine: sa.Engine, envelopes: list[Envelope]) -> list[Envelope]:
    with engine.begin() as conn:
        OutboxWriter(clock=ClockDouble()).add_many(conn, envelopes)
    return envelopes


def statuses(engine: sa.Engine) -> dict[str, tuple[int, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(t.c.message_id, t.c.status, t.c.claimed_by)).all()
    return {message_id: (status, claimed_by) for message_id, status, claimed_by in rows}


def is_postgres(engine: sa.Engine) -> bool:
    return engine.dialect.name == "postgresql"


# -- the order guard --------------------------------------------------------------------------


def test_the_guard_holds_back_what_follows_a_row_another_claim_holds(engine: sa.Engine) -> None:
    messages = write(
        engine,
        [envelope("a", 0), envelope("b", 0), envelope("a", 1), envelope("c"), envelope("a", 2)],
    )
    log = StatementLog(engine)
    strategy = claims.strategy_for(engine)  # SKIP LOCKED, or leases on SQLite
    now = ClockDouble().now() + timedelta(seconds=1)
    with strategy.claim(engine, 1, now) as first, strategy.claim(engine, 100, now) as second:
        assert [r.message_id for r in first.rows] == [messages[0].message_id]
        # a1 and a2 are claimed by the second but wait behind a0, which the first holds.
        ids = {m.message_id: i for i, m in enumerate(messages)}
        assert [ids[r.message_id] for r in second.rows] == [1, 3]
        assert all(isinstance(r, claims.OutboxRow) for r in second.rows)

    if is_postgres(engine):
        # The claim carries its guard: one statement per claim, no key or id list sent over.
        claim_sql = log.matching("FOR UPDATE SKIP LOCKED")
        assert len(claim_sql) == 2 and not log.matching("GROUP BY outbox_messages.partition_key")
        sql, params = claim_sql[-1]
        assert "blockers AS MATERIALIZED" in sql and set(params) == {"now", "limit"}
    else:
        guard_sql, params = log.matching("GROUP BY outbox_messages.partition_key")[-1]
        assert "partition_key IN (" in guard_sql and "id NOT IN (" in guard_sql
        assert len(params) == 3 + 4 + 1  # three keys, four ids, the highest id


@pytest.mark.postgres
def test_the_optimistic_guard_binds_keys_and_ids_as_arrays_on_postgresql(pg_url: str) -> None:
    engine = db.create_engine(pg_url, pool_size=4)
    try:
        messages = write(engine, [envelope("a", 0), envelope("b"), envelope("a", 1)])
        strategy = claims.OptimisticClaim()
        now = ClockDouble().now() + timedelta(seconds=1)
        with strategy.claim(engine, 1, now) as first:  # leases a0
            log = StatementLog(engine)
            with strategy.claim(engine, 100, now) as second:
                assert [r.message_id for r in first.rows] == [messages[0].message_id]
                assert [r.message_id for r in second.rows] == [messages[1].message_id]
        ((guard_sql, params),) = log.matching("GROUP BY outbox_messages.partition_key")
        assert "= ANY (" in guard_sql and " IN (" not in guard_sql.split("WHERE", 1)[1]
        assert len(params) == 3 and sorted(params["keys"]) == ["a", "b"]
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_a_guarded_claim_skips_keys_another_relay_holds_in_any_batch(pg_url: str) -> None:
    """The claim's own guard, against the two-statement guard, on random batches of a few keys
    while another transaction holds some rows: the same rows come out."""
    engine = db.create_engine(pg_url, pool_size=4)
    rng = random.Random(5)
    now = ClockDouble().now() + timedelta(seconds=1)
    held_back = 0
    try:
        write(engine, [envelope(f"k{rng.randrange(6)}", n) for n in range(60)])
        for _ in range(20):
            held, limit = rng.randrange(0, 5), rng.randrange(1, 60)
            with engine.connect() as other, other.begin(), engine.connect() as conn:
                some = sa.select(t.c.id).order_by(sa.func.random()).limit(held)
                other.execute(sa.select(t.c.id).where(t.c.id.in_(some)).with_for_update()).all()
                stmts = claims.statements(conn)
                with conn.begin() as tx:
                    params = {"now": now, "limit": limit}
                    one = [r.id for r in conn.execute(stmts.guarded_claim, params)]
                    tx.rollback()
                with conn.begin():
                    claimed = conn.execute(stmts.claim, params).all()
                    two = [r.id for r in claims.order_guard(conn, claimed)]
            assert one == two and len(one) <= limit
            held_back += len(claimed) - len(two)
        assert held_back > 0  # the guard had rows to hold back
    finally:
        engine.dispose()


def test_a_guard_with_nothing_blocking_publishes_the_whole_claim(engine: sa.Engine) -> None:
    write(engine, [envelope(f"k{i % 7}", i // 7) for i in range(40)])
    with claims.strategy_for(engine).claim(engine, 40, START + timedelta(seconds=1)) as claim:
        assert len(claim.rows) == 40
        assert [r.id for r in claim.rows] == sorted(r.id for r in claim.rows)


# -- large batches: one array, or an IN list of every id ----------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "optimistic"])
def test_a_batch_of_1200_is_claimed_published_and_marked(engine: sa.Engine, strategy: str) -> None:
    write(engine, [envelope(f"k{i}") for i in range(1200)])
    clock = ClockDouble(START + timedelta(seconds=1))
    config = RelayConfig(batch_size=1200, claim=strategy, on_sent="mark")  # the rows stay
    relay = Relay(engine, MemoryTransport(), config, clock=clock)
    log = StatementLog(engine)
    assert relay.run_once() == BatchOutcome(published=1200, retried=0, failed=0, claimed=1200)
    with engine.connect() as conn:
        marked = conn.execute(
            sa.select(t.c.status, t.c.sent_at, t.c.updated_at, t.c.claimed_by, t.c.lease_until)
        ).all()
    assert set(marked) == {(SENT, clock.now(), clock.now(), None, None)}
    ((mark_sql, params),) = log.matching("SET status=1")
    if is_postgres(engine):
        assert "id = ANY (" in mark_sql and len(params["ids"]) == 1200
    else:
        assert "id IN (" in mark_sql


def test_a_leased_batch_releases_the_rows_it_did_not_attempt(engine: sa.Engine) -> None:
    messages = write(engine, [envelope("a", n) for n in range(3)] + [envelope("b")])
    transport = FailingTransportDouble(failing={messages[0].message_id})
    clock = ClockDouble(START + timedelta(seconds=1))
    config = RelayConfig(claim="optimistic", backoff_base=60, on_sent="mark")  # the rows stay
    relay = Relay(engine, transport, config, clock=clock, rng=random.Random(3))
    assert relay.run_once() == BatchOutcome(published=1, retried=1, failed=0, claimed=4)
    after = statuses(engine)
    # a0 failed (back in backoff), a1 and a2 were never attempted: all PENDING and unleased.
    assert [after[m.message_id] for m in messages] == [(PENDING, None)] * 3 + [(SENT, None)]
    with engine.connect() as conn:
        leases = conn.execute(sa.select(t.c.lease_until).where(t.c.status == PENDING)).scalars()
        assert set(leases) == {None}


def test_marks_of_a_leased_batch_skip_rows_another_relay_took(engine: sa.Engine) -> None:
    write(engine, [envelope(f"k{i}") for i in range(3)])
    strategy = claims.OptimisticClaim(timedelta(seconds=30))
    now = START + timedelta(seconds=1)
    with strategy.claim(engine, 10, now) as claim:
        with engine.begin() as conn:  # the lease ran out and another relay leased the rows
            conn.execute(sa.update(t).values(claimed_by="thief"))
        relay = Relay(engine, MemoryTransport(), RelayConfig(claim="optimistic"))
        results = [PublishResult(r.message_id) for r in claim.rows]
        assert relay._mark(claim, results).published == 0
    assert {s for s, _ in statuses(engine).values()} == {PENDING}


# -- on_sent="delete": acknowledged rows go at once ------------------------------------------


@pytest.mark.parametrize("strategy", ["auto", "optimistic"])
def test_on_sent_delete_deletes_the_acknowledged_rows_and_keeps_the_failed(
    engine: sa.Engine, strategy: str
) -> None:
    messages = write(engine, [envelope("a", 0), envelope("a", 1), envelope("b"), envelope("c")])
    failing = messages[2].message_id
    config = RelayConfig(claim=strategy, on_sent="delete", backoff_base=60)
    clock = ClockDouble(START + timedelta(seconds=1))
    relay = Relay(engine, FailingTransportDouble({failing}), config, clock=clock)
    log = StatementLog(engine)
    assert relay.run_once() == BatchOutcome(published=3, retried=1, failed=0, claimed=4)
    with engine.connect() as conn:
        left = conn.execute(sa.select(t.c.message_id, t.c.status, t.c.retry_count)).all()
    assert left == [(failing, PENDING, 1)]  # in backoff, for the next attempt
    ((delete_sql, params),) = log.matching("DELETE ")
    if is_postgres(engine):
        assert "id = ANY (" in delete_sql and len(params["ids"]) == 3
    else:
        assert_deleted_by_primary_key(engine, delete_sql, params, 3)
    assert not log.matching("SET status=1")


def assert_deleted_by_primary_key(engine: sa.Engine, sql: str, params: Any, rows: int) -> None:
    """On MySQL and MariaDB one DELETE per row, by primary key: a DELETE of a list of ids may
    read (and wait for) rows another relay holds, and deadlock. Elsewhere one DELETE of the list."""
    if engine.dialect.name in ("mysql", "mariadb"):
        assert sql.startswith(f"DELETE FROM {t.name} WHERE {t.name}.id = %(id)s")
        assert isinstance(params, list | tuple) and len(params) == rows  # one executemany
    else:
        assert "id IN (" in sql


def test_on_sent_delete_of_a_leased_batch_spares_rows_another_relay_took(
    engine: sa.Engine,
) -> None:
    write(engine, [envelope(f"k{i}") for i in range(3)])
    strategy = claims.OptimisticClaim(timedelta(seconds=30))
    with strategy.claim(engine, 10, START + timedelta(seconds=1)) as claim:
        with engine.begin() as conn:  # the lease ran out and another relay leased the rows
            conn.execute(sa.update(t).values(claimed_by="thief"))
        config = RelayConfig(claim="optimistic", on_sent="delete")
        relay = Relay(engine, MemoryTransport(), config)
        results = [PublishResult(r.message_id) for r in claim.rows]
        assert relay._mark(claim, results).published == 0
    assert sorted(s for s, _ in statuses(engine).values()) == [PENDING] * 3


# -- on_sent="archive": acknowledged rows move to outbox_history ---------------------------


@pytest.fixture(
    params=[
        pytest.param("pg_url", marks=pytest.mark.postgres, id="postgres"),
        pytest.param("mariadb_url", marks=pytest.mark.mariadb, id="mariadb"),
    ]
)
def server_engine(request: pytest.FixtureRequest) -> Iterator[sa.Engine]:
    """An engine on each database that can archive (SQLite refuses: see the test after these)."""
    engine = db.create_engine(request.getfixturevalue(request.param), pool_size=4)
    yield engine
    engine.dispose()


@pytest.mark.parametrize("strategy", ["auto", "optimistic"])
def test_on_sent_archive_moves_the_acknowledged_rows_to_history_and_keeps_the_failed(
    server_engine: sa.Engine, strategy: str
) -> None:
    engine = server_engine
    messages = write(engine, [envelope("a", 0), envelope("a", 1), envelope("b"), envelope("c")])
    failing = messages[2].message_id
    with engine.connect() as conn:
        written = {r.message_id: r for r in conn.execute(sa.select(t)).all()}
    config = RelayConfig(claim=strategy, on_sent="archive", backoff_base=60)
    clock = ClockDouble(LATER)
    relay = Relay(engine, FailingTransportDouble({failing}), config, clock=clock)
    log = StatementLog(engine)
    assert relay.run_once() == BatchOutcome(published=3, retried=1, failed=0, claimed=4)

    with engine.connect() as conn:
        left = conn.execute(sa.select(t.c.message_id, t.c.status, t.c.retry_count)).all()
        archived = conn.execute(sa.select(schema.outbox_history)).all()
    assert left == [(failing, PENDING, 1)]  # in backoff, for the next attempt
    assert sorted(r.message_id for r in archived) == sorted(set(written) - {failing})
    for row in archived:  # every column carried over; SENT, stamped with the relay's clock
        before = written[row.message_id]
        for name in schema.ARCHIVED_COLUMNS:
            if name not in ("status", "sent_at", "updated_at"):
                assert getattr(row, name) == getattr(before, name), name
        assert (row.status, row.sent_at, row.updated_at, row.archived_at) == (SENT, *[LATER] * 3)
    if is_postgres(engine):
        ((sql, params),) = log.matching("INSERT INTO outbox_history")
        assert "WITH moved AS (DELETE FROM outbox_messages" in sql and len(params["ids"]) == 3
    else:
        ((insert_sql, _),) = log.matching("INSERT INTO outbox_history")
        ((delete_sql, params),) = log.matching("DELETE ")
        assert "id IN (" in insert_sql
        assert_deleted_by_primary_key(engine, delete_sql, params, 3)
        assert log.sent.index(log.matching("INSERT INTO outbox_history")[0]) < log.sent.index(
            log.matching("DELETE ")[0]
        )
    assert not log.matching("SET status=1")
    signals = admin.signals(engine, clock=clock)  # archived rows count as sent
    assert (signals.pending, signals.sent, signals.latency_p50_ms) == (1, 3, 1000.0)


def test_on_sent_archive_of_a_leased_batch_spares_rows_another_relay_took(
    server_engine: sa.Engine,
) -> None:
    engine = server_engine
    write(engine, [envelope(f"k{i}") for i in range(3)])
    strategy = claims.OptimisticClaim(timedelta(seconds=30))
    with strategy.claim(engine, 10, START + timedelta(seconds=1)) as claim:
        with engine.begin() as conn:  # the lease ran out and another relay leased the rows
            conn.execute(sa.update(t).where(t.c.id != claim.rows[0].id).values(claimed_by="thief"))
        relay = Relay(engine, MemoryTransport(), RelayConfig(claim="optimistic", on_sent="archive"))
        results = [PublishResult(r.message_id) for r in claim.rows]
        assert relay._mark(claim, results).published == 1  # only the row still ours
    assert sorted(s for s, _ in statuses(engine).values()) == [PENDING] * 2
    with engine.connect() as conn:
        archived = conn.scalars(sa.select(schema.outbox_history.c.id)).all()
    assert archived == [claim.rows[0].id]


def test_relays_archive_by_default_on_postgresql_and_mark_elsewhere(
    server_engine: sa.Engine,
) -> None:
    engine = server_engine
    write(engine, [envelope("a", 0), envelope("a", 1), envelope("b")])
    relay = Relay(engine, MemoryTransport(), RelayConfig(), clock=ClockDouble(LATER))
    archives = is_postgres(engine)  # on MariaDB a DELETE of a batch may scan: see on_sent_for
    assert (RelayConfig().on_sent, relay.on_sent) == ("auto", "archive" if archives else "mark")
    assert relay.run_once().published == 3
    with engine.connect() as conn:
        left = conn.execute(sa.select(t.c.status)).scalars().all()
        archived = conn.execute(sa.select(schema.outbox_history.c.status)).scalars().all()
    assert (left, archived) == (([], [SENT] * 3) if archives else ([SENT] * 3, []))


@pytest.mark.sqlite
def test_sqlite_refuses_on_sent_archive_and_marks_by_default(sqlite_url: str) -> None:
    engine = db.create_engine(sqlite_url)
    try:
        with pytest.raises(ConfigurationError, match="SQLite reuses them"):
            Relay(engine, MemoryTransport(), RelayConfig(on_sent="archive"))
        assert Relay(engine, MemoryTransport(), RelayConfig()).on_sent == "mark"  # auto
        for on_sent in ("mark", "delete"):  # the others are as given
            assert Relay(engine, MemoryTransport(), RelayConfig(on_sent=on_sent)).on_sent == on_sent
    finally:
        engine.dispose()


# -- the claim's plans ----------------------------------------------------------------------


@pytest.mark.postgres
def test_a_large_optimistic_claim_plans_its_guard_for_its_own_parameters(pg_url: str) -> None:
    """psycopg prepares a statement on its fifth execution; PostgreSQL's generic plan for the
    order guard then compared every row with every claimed id (4 ms a batch instead of 0.8)."""
    engine = db.create_engine(pg_url, pool_size=1)
    large, small = claims.CUSTOM_PLANS_FROM, claims.CUSTOM_PLANS_FROM - 1
    now = START + timedelta(seconds=1)
    log = StatementLog(engine)
    try:
        write(engine, [envelope(f"k{i}") for i in range(large)])
        with claims.OptimisticClaim().claim(engine, large, now) as claim:
            assert len(claim.rows) == large
        assert len(log.matching(claims.CUSTOM_PLANS)) == 1
        with engine.connect() as conn:  # the same pooled connection, after the claim's commit
            assert plan_cache_mode(conn) == "auto"
        # A small claim keeps the generic plans: its guard is cheap either way, and the extra
        # round trip would only add to the delivery latency.
        with engine.begin() as conn:
            conn.execute(sa.update(t).values(claimed_by=None, lease_until=None))
        with claims.OptimisticClaim().claim(engine, small, now) as claim:
            assert len(claim.rows) == small
        assert len(log.matching(claims.CUSTOM_PLANS)) == 1
        # A SKIP LOCKED claim guards in its own statement, which binds no list to plan for.
        with claims.SkipLockedClaim().claim(engine, large, now) as claim:
            assert len(claim.rows) == large
        assert len(log.matching(claims.CUSTOM_PLANS)) == 1
    finally:
        engine.dispose()


def analyze_while_empty(engine: sa.Engine) -> None:
    """``VACUUM (ANALYZE)`` the empty outbox: the statistics of a queue at a quiet moment."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM (ANALYZE) outbox_messages")


def plan_cache_mode(conn: sa.Connection) -> str | None:
    return conn.exec_driver_sql("SHOW plan_cache_mode").scalar()


@pytest.mark.postgres
def test_a_relays_own_pool_plans_each_pass_for_the_table_as_it_is(pg_url: str) -> None:
    """The outbox is often empty when it is analyzed. A generic plan made then (a sequential
    scan) would serve every later pass, however large the table grew, until the next ANALYZE."""
    plain = db.create_engine(pg_url, pool_size=1)
    config = RelayConfig(pool_size=1)
    own = Relay.for_database(pg_url, MemoryTransport(), config, clock=ClockDouble(LATER))
    try:
        analyze_while_empty(plain)
        shared = Relay(plain, MemoryTransport(), config, clock=ClockDouble(LATER))
        for relay in (shared, own):
            for i in range(PASSES):
                write(plain, [envelope(f"{relay is own}-{i}")])
                assert relay.run_once().published == 1
        claim_sql = "%FOR UPDATE SKIP LOCKED%"
        assert plans(plain, claim_sql)["generic"] > 0  # what the relay's own pool avoids
        own_plans = plans(own.engine, claim_sql)
        assert own_plans["generic"] == 0 and own_plans["custom"] > 0
        with own.engine.begin() as conn:
            assert plan_cache_mode(conn) == "force_custom_plan"
    finally:
        plain.dispose()
        own.engine.dispose()


@pytest.mark.postgres
def test_a_relays_own_pool_needs_no_set_local_for_a_large_claim(pg_url: str) -> None:
    relay = Relay.for_database(
        pg_url, MemoryTransport(), RelayConfig(pool_size=1), clock=ClockDouble(LATER)
    )
    plain = db.create_engine(pg_url, pool_size=1)
    try:
        write(plain, [envelope(f"k{i}") for i in range(claims.CUSTOM_PLANS_FROM)])
        log = StatementLog(relay.engine)
        assert relay.run_once().published == claims.CUSTOM_PLANS_FROM
        assert log.matching("plan_cache_mode") == []  # the session plans each statement anyway
        with relay.engine.begin() as conn:
            assert plan_cache_mode(conn) == "force_custom_plan"
    finally:
        plain.dispose()
        relay.engine.dispose()


@pytest.mark.postgres
def test_only_a_relays_own_sessions_commit_without_waiting_for_the_disk(pg_url: str) -> None:
    """A relay's commit records deliveries the broker already holds: lost in a server crash, the
    rows are sent again. Business transactions, and every other engine, keep waiting."""
    relay = Relay.for_database(
        pg_url, MemoryTransport(), RelayConfig(pool_size=1), clock=ClockDouble(LATER)
    )
    plain = db.create_engine(pg_url, pool_size=1)
    try:
        [sent] = write(plain, [envelope("order-1")])
        assert relay.run_once().published == 1
        with relay.engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "off"
        with plain.connect() as conn:
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
            history = sa.select(schema.outbox_history.c.message_id)
            assert conn.scalars(history).all() == [sent.message_id]  # committed all the same
    finally:
        plain.dispose()
        relay.engine.dispose()


@pytest.mark.postgres
def test_a_relays_own_pool_flags_the_dead_entries_a_bitmap_scan_visits_on_every_claim(
    pg_url: str,
) -> None:
    """Each marked row leaves a dead entry in the indexes of PENDING rows until VACUUM. A bitmap
    scan (what the planner picks for the claim on statistics of an empty outbox) visits each such
    entry on every claim and never flags it. The relay's own sessions use plain index scans,
    which flag a dead entry on their first visit, so that every later scan skips it."""
    plain = db.create_engine(pg_url, pool_size=1)
    config = RelayConfig(pool_size=1)
    own = Relay.for_database(pg_url, MemoryTransport(), config, clock=ClockDouble(LATER))
    try:
        analyze_while_empty(plain)
        write(plain, [envelope(f"k{i}") for i in range(20_000)])
        with plain.begin() as conn:  # as relays would, leaving 20,000 dead entries
            conn.execute(sa.update(t).values(status=SENT, sent_at=LATER))
        write(plain, [envelope("last")])
        other = claim_plan(plain)
        assert "Bitmap" in other
        first = claim_plan(own.engine)
        assert "Bitmap" not in first
        again = claim_plan(own.engine)
        assert buffers(again) * 5 < buffers(other)  # the dead entries flagged, then skipped
        assert buffers(again) * 5 < buffers(first)
    finally:
        plain.dispose()
        own.engine.dispose()


def claim_plan(engine: sa.Engine) -> str:
    """``EXPLAIN (ANALYZE, BUFFERS)`` of the relay's claim in one of ``engine``'s sessions."""
    with engine.begin() as conn:
        sql = claims.statements(conn).claim.compile(dialect=conn.dialect)
        lines = conn.exec_driver_sql(
            f"EXPLAIN (ANALYZE, BUFFERS) {sql}", {"now": LATER, "limit": 500}
        ).scalars()
        return "\n".join(lines)


def buffers(plan: str) -> int:
    """The shared buffers the whole statement touched (the plan's first ``Buffers:`` line)."""
    line = next(line for line in plan.splitlines() if "Buffers: shared" in line)
    return sum(int(part.split("=")[1]) for part in line.split(":")[1].split() if "=" in part)


#: psycopg prepares a statement on its 5th execution, and PostgreSQL plans the first 5 executions
#: of a prepared statement for their parameters before it weighs a generic plan.
PASSES = 12


def plans(engine: sa.Engine, statement_like: str) -> dict[str, int]:
    """How often the prepared statements matching ``statement_like`` of ``engine``'s one pooled
    session were run with a generic and with a custom plan."""
    with engine.begin() as conn:  # committed: psycopg forgets its prepared statements on rollback
        row = conn.execute(
            sa.text(
                "SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0)"
                " FROM pg_prepared_statements WHERE statement LIKE :like"
            ),
            {"like": statement_like},
        ).one()
    return {"generic": int(row[0]), "custom": int(row[1])}


# -- the writer ---------------------------------------------------------------------------------


def test_the_writer_stores_every_field_as_given(engine: sa.Engine) -> None:
    full = envelope(
        "o-1",
        correlation_id="saga-1",
        causation_id="m-0",
        tenant_id="acme",
        headers={"traceparent": "00-abc-01", "note": "é"},
    )
    full = full.model_copy(update={"payload": {"note": 'Grüße, 订单 "q"', "n": [1, 2.5, None]}})
    bare = envelope("o-2")
    log = StatementLog(engine)
    with Session(engine) as session, session.begin():
        OutboxWriter(clock=ClockDouble()).add(session, full)
    with engine.begin() as conn:
        OutboxWriter(clock=ClockDouble()).add_many(conn, [bare, envelope("o-3"), envelope("o-4")])
    inserts = log.matching("INSERT INTO outbox_messages")
    assert len(inserts) == 2 and not any("RETURNING" in sql for sql, _ in inserts)

    with engine.connect() as conn:
        stored = {r.message_id: r for r in conn.execute(sa.select(t)).all()}
    assert len(stored) == 4
    row = stored[full.message_id]
    assert (row.message_type, row.destination, row.partition_key) == ("Tick", "ticks", "o-1")
    assert (row.aggregate_type, row.aggregate_id) == ("Ticker", "o-1")
    assert (row.correlation_id, row.causation_id, row.tenant_id) == ("saga-1", "m-0", "acme")
    assert row.headers == '{"traceparent":"00-abc-01","note":"\\u00e9"}'
    assert row.payload == '{"note":"Grüße, 订单 \\"q\\"","n":[1,2.5,null]}'
    assert (row.status, row.retry_count, row.sent_at, row.last_error) == (PENDING, 0, None, None)
    assert (row.next_retry_at, row.created_at, row.updated_at) == (START, START, START)
    assert (row.claimed_by, row.lease_until) == (None, None)
    empty = stored[bare.message_id]
    assert (empty.headers, empty.correlation_id, empty.tenant_id) == ("{}", None, None)


def test_a_duplicate_message_id_raises_the_usual_integrity_error(engine: sa.Engine) -> None:
    once = envelope("dup")
    write(engine, [once])
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        OutboxWriter().add(conn, once)


@pytest.mark.postgres
def test_the_writer_honours_a_schema_translate_map(pg_url: str) -> None:
    """Precompiled SQL names no schema; a connection that maps one gets the compiled insert."""
    engine = db.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE SCHEMA elsewhere"))
            conn.execute(
                sa.text(
                    "CREATE TABLE elsewhere.outbox_messages (LIKE outbox_messages INCLUDING ALL)"
                )
            )
        moved = engine.execution_options(schema_translate_map={None: "elsewhere"})
        with moved.begin() as conn:
            OutboxWriter().add(conn, envelope("moved"))
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT count(*) FROM elsewhere.outbox_messages")) == 1
            assert conn.scalar(sa.text("SELECT count(*) FROM public.outbox_messages")) == 0
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_the_backoff_lookup_of_a_claim_does_not_read_every_pending_row(pg_url: str) -> None:
    """The claim's lookup of keys in retry backoff seeks to the first such row in the partial
    index; with ``next_retry_at > now`` alone PostgreSQL read the whole index on every claim."""
    engine = db.create_engine(pg_url)
    try:
        write(engine, [envelope(f"k{i}") for i in range(20_000)])
        now = START + timedelta(seconds=1)
        with engine.begin() as conn:
            conn.execute(sa.text("ANALYZE outbox_messages"))
            conn.execute(  # one key in backoff, so the lookup has a row to find
                sa.update(t).where(t.c.partition_key == "k7").values(next_retry_at=START + HOUR)
            )
            sql = claims.statements(conn).claim.compile(dialect=conn.dialect)
            [[plan]] = conn.exec_driver_sql(
                f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}",
                {"now": now, "limit": 500},
            ).all()
        lookup = subplan_scan(plan[0]["Plan"])
        assert lookup["Index Name"] == "ix_outbox_messages_status_next_retry_at_id"
        assert lookup["Actual Rows"] == 1
        # The whole index of 20,000 PENDING rows spans about 80 pages; a seek reads a handful.
        assert lookup["Shared Hit Blocks"] + lookup["Shared Read Blocks"] < 10
    finally:
        engine.dispose()


HOUR = timedelta(hours=1)


def subplan_scan(node: dict[str, Any]) -> dict[str, Any]:
    """The plan node that scans for the backoff lookup (the claim's one subplan)."""
    if node.get("Subplan Name", "").startswith("SubPlan"):
        return node
    for child in node.get("Plans", []):
        found = subplan_scan(child)
        if found:
            return found
    return {}


# -- array parameters -----------------------------------------------------------------------


@pytest.mark.postgres
def test_array_parameters_go_in_binary_and_keep_every_value(pg_url: str) -> None:
    """psycopg writes a text array element by element in Python (0.47 ms for a batch's 500 ids);
    :class:`db.Array` parameters go in its binary form, whatever their values."""
    from psycopg import pq
    from psycopg.adapt import PyFormat

    engine = db.create_engine(pg_url, pool_size=1)
    formats: list[pq.Format] = []

    def note_formats(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        adapters = cursor.connection.adapters
        for value in parameters.values():
            if isinstance(value, list):
                formats.append(adapters.get_dumper(type(value), PyFormat.AUTO).format)

    sa.event.listen(engine, "before_cursor_execute", note_formats)
    keys = ["plain", 'quo"te', "back\\slash", "{braces}", "a,b", "", "NULL", "订单 é", " lead"]
    ids = [1, 2**15, 2**40]
    as_ids = sa.bindparam("v", type_=db.Array(sa.BigInteger()))
    as_keys = sa.bindparam("v", type_=db.Array(sa.String(255)))
    try:
        with engine.connect() as conn:
            unnest = sa.select(sa.func.unnest(as_ids))
            assert conn.scalars(unnest, {"v": ids}).all() == ids
            assert conn.scalars(unnest, {"v": [None, 7]}).all() == [None, 7]
            assert conn.scalars(unnest, {"v": []}).all() == []
            assert conn.scalars(sa.select(sa.func.unnest(as_keys)), {"v": keys}).all() == keys
            many = list(range(10_000, 10_500))
            matches = sa.select(sa.func.count()).where(sa.literal(10_499) == sa.any_(as_ids))
            assert conn.scalar(matches, {"v": many}) == 1
    finally:
        engine.dispose()
    assert formats and set(formats) == {pq.Format.BINARY}


@pytest.mark.postgres
def test_the_first_engine_of_a_process_sends_arrays_in_binary(pg_url: str) -> None:
    """SQLAlchemy's dialect copies psycopg's adapters when the engine is made: the binary form
    must be registered before that, in a process that has made no engine yet."""
    probe = (
        "import sys\n"
        "import sqlalchemy as sa\n"
        "from psycopg import pq\n"
        "from psycopg.adapt import PyFormat\n"
        "from saga_engine import db\n"
        "engine = db.create_engine(sys.argv[1], pool_size=1)\n"
        "with engine.connect() as conn:\n"
        "    adapters = conn.connection.dbapi_connection.adapters\n"
        "    dumper = adapters.get_dumper(db._BinaryList, PyFormat.AUTO)\n"
        "print(dumper.format == pq.Format.BINARY)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, pg_url], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
