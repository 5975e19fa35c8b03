"""The relay against real databases: retries and backoff, outages, leases, order under races, NOTIFY.

Time is stepped with :class:`ClockDouble` instead of slept; broker behaviour comes from transport
doubles (named ``...Double``) that fail chosen or random messages, alone or in front of the real
SQL-table transport.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from saga_engine import db, schema, status
from saga_engine.messages import Envelope
from saga_engine.outbox import OutboxWriter, admin
from saga_engine.outbox import claim as claims
from saga_engine.outbox.relay import BatchOutcome, Relay, RelayConfig, relay_wakeup
from saga_engine.transport.base import Consumer, OutgoingMessage, PublishResult, Transport
from saga_engine.transport.sql import SqlTransport
from tests.support.databases import fresh_database

t = schema.outbox
PENDING, SENT, FAILED = schema.OutboxStatus
START = datetime(2030, 1, 1, 12, 0, 0)


class ClockDouble:
    """A clock the test steps by hand (the ``clock.Clock`` protocol)."""

    def __init__(self, start: datetime = START) -> None:
        self.current = start

    def now(self) -> datetime:
        return self.current

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)


class FailingTransportDouble(Transport):
    """Fails the message ids in ``failing`` (every message while ``down``); the others succeed,
    through ``inner`` when one is given. Records each publish call's message ids."""

    name = "failing-double"

    def __init__(self, inner: Transport | None = None) -> None:
        self.inner = inner
        self.failing: set[str] = set()
        self.down = False
        self.calls: list[list[str]] = []
        self.on_publish: Callable[[Sequence[OutgoingMessage]], None] | None = None

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        self.calls.append([m.message_id for m in messages])
        if self.on_publish is not None:
            self.on_publish(messages)
        if self.down:
            return [
                PublishResult(m.message_id, "broker unreachable (double)", unreachable=True)
                for m in messages
            ]
        results = {
            m.message_id: PublishResult(m.message_id, f"rejected {m.message_id} (double)")
            for m in messages
            if m.message_id in self.failing
        }
        accepted = [m for m in messages if m.message_id not in self.failing]
        if self.inner is not None and accepted:
            results.update((r.message_id, r) for r in self.inner.publish(accepted, timeout))
        else:
            results.update((m.message_id, PublishResult(m.message_id)) for m in accepted)
        return [results[m.message_id] for m in messages]

    def consumer(self, group: str, channels: Sequence[str]) -> Consumer:
        assert self.inner is not None
        return self.inner.consumer(group, channels)

    @property
    def published(self) -> list[str]:
        return [message_id for call in self.calls for message_id in call]


class RaisingTransportDouble(FailingTransportDouble):
    """Breaks the port's contract by raising instead of returning per-message errors."""

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        raise RuntimeError("adapter bug (double)")


class RandomFailureTransportDouble(Transport):
    """Fails ~``rate`` of publishes at random and logs, under one lock, every attempt in order.

    ``violations`` collects attempts of a message made before every earlier message of its key
    (``order[message_id] = (key, n)``) had been acknowledged: the per-key order guarantee.
    """

    name = "random-double"

    def __init__(self, order: dict[str, tuple[str, int]], rate: float, seed: int) -> None:
        self.order = order
        self.rate = rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.attempts: list[tuple[str, bool]] = []
        self.acked: dict[str, set[int]] = defaultdict(set)
        self.violations: list[str] = []

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        results = []
        with self.lock:
            for m in messages:
                key, n = self.order[m.message_id]
                missing = set(range(n)) - self.acked[key]
                if missing:
                    self.violations.append(f"{key}#{n} attempted before #{min(missing)} was acked")
                ok = self.rng.random() >= self.rate
                self.attempts.append((m.message_id, ok))
                if ok:
                    self.acked[key].add(n)
                results.append(PublishResult(m.message_id, None if ok else "random failure"))
        time.sleep(self.rng.random() * 0.002)  # let the relays interleave
        return results

    def consumer(self, group: str, channels: Sequence[str]) -> Consumer:
        raise NotImplementedError


# -- helpers ------------------------------------------------------------------------------------


def envelope(key: str, n: int = 0, destination: str = "ticks") -> Envelope:
    return Envelope(
        message_type="Tick",
        destination=destination,
        partition_key=key,
        aggregate_type="Ticker",
        aggregate_id=key,
        payload={"key": key, "n": n},
    )


def make_engine(url: str, engines: list[object], pool_size: int = 5) -> sa.Engine:
    engine = db.create_engine(url, pool_size=pool_size)
    engines.append(engine)
    return engine


def write(engine: sa.Engine, envelopes: Iterable[Envelope], clock: Any = None) -> list[Envelope]:
    envelopes = list(envelopes)
    writer = OutboxWriter() if clock is None else OutboxWriter(clock=clock)
    with engine.begin() as conn:
        writer.add_many(conn, envelopes)
    return envelopes


def outbox_rows(engine: sa.Engine) -> dict[str, sa.Row[Any]]:
    """Every message written, by id: the outbox's rows, and those the relays moved to the history
    (``on_sent="auto"`` archives on PostgreSQL and marks elsewhere)."""
    rows: dict[str, sa.Row[Any]] = {}
    with engine.connect() as conn:
        for table in (schema.outbox_history, t):
            rows |= {r.message_id: r for r in conn.execute(sa.select(table).order_by(table.c.id))}
    return rows


def delivered(engine: sa.Engine, *message_ids: str) -> int:
    """How many of ``message_ids`` are SENT, wherever the relay left them."""
    return sum(
        count(engine, table, table.c.message_id.in_(message_ids), table.c.status == SENT)
        for table in (t, schema.outbox_history)
    )


def count(engine: sa.Engine, table: sa.Table, *where: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(table).where(*where)) or 0)


def drain(relay: Relay, limit: int = 100) -> list[BatchOutcome]:
    """run_once until a pass claims nothing."""
    outcomes = []
    for _ in range(limit):
        outcome = relay.run_once()
        if outcome.claimed == 0:
            return outcomes
        outcomes.append(outcome)
    raise AssertionError(f"relay still busy after {limit} passes")


def assert_delay(row: sa.Row[Any], now: datetime, expected: float, jitter: float) -> None:
    delay = (row.next_retry_at - now).total_seconds()
    assert expected * (1 - jitter) - 1e-6 <= delay <= expected * (1 + jitter) + 1e-6, (
        delay,
        expected,
    )


# -- 1. retries, backoff, FAILED, requeue -------------------------------------------------------


def test_one_failure_in_a_batch_leaves_the_others_sent(db_url: str, engines: list[object]) -> None:
    engine = make_engine(db_url, engines)
    clock = ClockDouble()
    sent = write(engine, [envelope(f"k{i}") for i in range(5)], clock)
    transport = FailingTransportDouble()
    transport.failing = {sent[2].message_id}
    config = RelayConfig(batch_size=10, backoff_base=2.0, backoff_cap=60.0, jitter=0.2)
    relay = Relay(engine, transport, config, clock=clock, rng=random.Random(1))

    assert relay.run_once() == BatchOutcome(published=4, retried=1, failed=0, claimed=5)

    rows = outbox_rows(engine)
    bad = rows.pop(sent[2].message_id)
    assert {(r.status, r.retry_count, r.sent_at, r.last_error) for r in rows.values()} == {
        (SENT, 0, START, None)
    }
    assert (bad.status, bad.retry_count, bad.sent_at) == (PENDING, 1, None)
    assert bad.last_error == f"rejected {sent[2].message_id} (double)"
    assert bad.claimed_by is None and bad.lease_until is None
    assert_delay(bad, START, 2.0, 0.2)
    assert (relay.stats.published, relay.stats.retried, relay.stats.failed) == (4, 1, 0)


def test_backoff_doubles_to_the_cap_then_failed_until_requeued(
    db_url: str, engines: list[object]
) -> None:
    engine = make_engine(db_url, engines)
    clock = ClockDouble()
    first = write(engine, [envelope("a")], clock)[0]
    transport = FailingTransportDouble()
    transport.failing = {first.message_id}
    config = RelayConfig(max_retries=5, backoff_base=1.0, backoff_cap=4.0, jitter=0.25)
    relay = Relay(engine, transport, config, clock=clock, rng=random.Random(2))

    # Failure n sets retry_count = n and waits min(cap, base * 2^(n-1)) +- jitter; the 5th is final.
    for attempt, expected_delay in enumerate([1.0, 2.0, 4.0, 4.0], start=1):
        assert relay.run_once().retried == 1
        (row,) = outbox_rows(engine).values()
        assert (row.status, row.retry_count) == (PENDING, attempt)
        assert row.last_error == f"rejected {first.message_id} (double)"
        assert_delay(row, clock.now(), expected_delay, 0.25)
        clock.current = row.next_retry_at - timedelta(milliseconds=1)
        assert relay.run_once().claimed == 0  # not due yet
        clock.current = row.next_retry_at
    assert relay.run_once() == BatchOutcome(published=0, retried=0, failed=1, claimed=1)
    (row,) = outbox_rows(engine).values()
    assert (row.status, row.retry_count, row.sent_at) == (FAILED, 5, None)
    assert row.last_error == f"rejected {first.message_id} (double)"
    clock.advance(86_400)  # a FAILED row is never picked up again on its own
    assert relay.run_once().claimed == 0

    # A second FAILED message, so that re-queueing by id can be told from re-queueing all.
    second = write(engine, [envelope("b")], clock)[0]
    transport.failing = {second.message_id}
    for _ in range(5):
        relay.run_once()
        clock.advance(10)
    assert admin.signals(engine, clock=clock).failed == 2
    assert relay.stats.failed == 2
    transport.failing.clear()
    assert admin.requeue_failed(engine, [first.message_id], clock=clock) == 1
    assert relay.run_once() == BatchOutcome(published=1, retried=0, failed=0, claimed=1)
    rows = outbox_rows(engine)
    assert (rows[first.message_id].status, rows[first.message_id].retry_count) == (SENT, 0)
    assert rows[second.message_id].status == FAILED
    assert admin.requeue_failed(engine, clock=clock) == 1
    assert relay.run_once().published == 1
    signals = admin.signals(engine, clock=clock)
    assert (signals.pending, signals.sent, signals.failed) == (0, 2, 0)


def test_signals_take_sent_from_the_statistics_of_a_table_over_the_limit(
    db_url: str, engines: list[object]
) -> None:
    engine = make_engine(db_url, engines)
    clock = ClockDouble()
    write(engine, [envelope(f"k{i}") for i in range(307)], clock)
    with engine.begin() as conn:
        ids = list(conn.scalars(sa.select(t.c.id).order_by(t.c.id)))
        settle = sa.update(t).where(t.c.id.in_(ids[:300])).values(status=SENT, sent_at=clock.now())
        conn.execute(settle)
        conn.execute(sa.update(t).where(t.c.id.in_(ids[300:302])).values(status=FAILED))
    exact = admin.signals(engine, clock=clock)
    assert (exact.pending, exact.sent, exact.failed, exact.sent_estimated) == (5, 300, 2, False)
    with engine.connect() as conn:  # statistics, as autovacuum or a nightly ANALYZE keeps them
        name = engine.dialect.name
        analyze = {"postgresql": "ANALYZE {}", "sqlite": "ANALYZE {}"}.get(name, "ANALYZE TABLE {}")
        for table in (t, schema.outbox_history):
            conn.exec_driver_sql(analyze.format(table.name))
        conn.commit()
    # Told to count no table, it estimates where the database keeps statistics.
    estimated = admin.signals(engine, clock=clock, exact_sent_up_to=0)
    assert (estimated.pending, estimated.failed) == (5, 2)  # always counted
    if name == "sqlite":  # no statistics to read: still a count
        assert (estimated.sent, estimated.sent_estimated) == (300, False)
    elif name == "postgresql":  # ANALYZE of a small table reads every row
        assert (estimated.sent, estimated.sent_estimated) == (300, True)
    else:  # InnoDB estimates from sampled pages
        assert estimated.sent_estimated and 150 <= estimated.sent <= 450
    report = status.collect(engine)  # the default limit: these tables are counted
    assert "pending 5, sent 300, failed 2" in status.render(report, "db")
    report["outbox"].update(admin.signals(engine, exact_sent_up_to=0).as_dict())
    said = "sent about" if estimated.sent_estimated else "sent 300"
    assert said in status.render(report, "db")


def test_a_transport_that_raises_counts_as_failed_publishes(
    db_url: str, engines: list[object]
) -> None:
    engine = make_engine(db_url, engines)
    clock = ClockDouble()
    write(engine, [envelope("a"), envelope("b")], clock)
    relay = Relay(engine, RaisingTransportDouble(), RelayConfig(), clock=clock)
    assert relay.run_once() == BatchOutcome(published=0, retried=2, failed=0, claimed=2)
    rows = outbox_rows(engine).values()
    assert {(r.status, r.retry_count) for r in rows} == {(PENDING, 1)}
    assert all("adapter bug (double)" in r.last_error for r in rows)


def test_a_key_in_backoff_does_not_starve_other_keys(db_url: str, engines: list[object]) -> None:
    """The rows queued behind a failed head of one key must not fill every batch."""
    engine = make_engine(db_url, engines)
    clock = ClockDouble()
    hot = write(engine, [envelope("hot", n) for n in range(12)], clock)
    cold = write(engine, [envelope("cold")], clock)[0]
    transport = FailingTransportDouble()
    transport.failing = {hot[0].message_id}
    relay = Relay(engine, transport, RelayConfig(batch_size=5, backoff_base=60), clock=clock)

    relay.run_once()  # the head of "hot" fails and backs off for a minute
    clock.advance(1)
    drain(relay)
    rows = outbox_rows(engine)
    assert rows[cold.message_id].status == SENT
    assert [rows[e.message_id].status for e in hot] == [PENDING] * 12
    assert hot[1].message_id not in transport.published  # nothing of "hot" overtook its head

    transport.failing.clear()
    clock.advance(120)
    drain(relay)
    assert {r.status for r in outbox_rows(engine).values()} == {SENT}


class CountingSqlTransportDouble(SqlTransport):
    """The real SQL transport, counting the messages of each publish call."""

    def __init__(self, engine: sa.Engine) -> None:
        super().__init__(engine)
        self.calls: list[int] = []

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        self.calls.append(len(messages))
        return super().publish(messages, timeout)


def test_a_batch_goes_out_in_waves_unless_the_transport_is_atomic(
    db_url: str, engines: list[object]
) -> None:
    engine = make_engine(db_url, engines)
    clock = ClockDouble()
    write(engine, [envelope("a", n) for n in range(3)] + [envelope("b", 0)], clock)
    per_message = FailingTransportDouble()  # results per message: one of a key at a time
    assert Relay(engine, per_message, clock=clock).run_once().published == 4
    assert [len(call) for call in per_message.calls] == [2, 1, 1]

    write(engine, [envelope("c", n) for n in range(20)], clock)
    atomic = CountingSqlTransportDouble(engine)  # all or nothing: the whole batch at once
    assert Relay(engine, atomic, clock=clock).run_once().published == 20
    assert atomic.calls == [20]


def test_a_poll_sends_the_oldest_rows_first_in_claims_that_double(
    db_url: str, engines: list[object]
) -> None:
    """The rows a poll finds waited up to an interval, the oldest longest: they go out first, in
    a claim of ``first_poll_batch`` rows, and each full claim is followed by one twice as large."""
    engine = make_engine(db_url, engines)
    ids = [e.message_id for e in write(engine, [envelope(f"k{i}") for i in range(40)])]
    transport = FailingTransportDouble()
    config = RelayConfig(batch_size=20, first_poll_batch=5, poll_interval=0.05)
    relay = Relay(engine, transport, config)  # no wake-up: every pass is a poll's
    relay.start()
    try:
        deadline = time.monotonic() + 10
        while len(transport.published) < len(ids) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        relay.stop()
    assert transport.calls == [ids[:5], ids[5:15], ids[15:35], ids[35:]]
    assert delivered(engine, *ids) == len(ids)


# -- 2. broker outage ---------------------------------------------------------------------------


def test_broker_outage_keeps_messages_pending_then_delivers_them(
    db_url: str, engines: list[object]
) -> None:
    engine = make_engine(db_url, engines)
    clock = ClockDouble()
    messages = write(engine, [envelope(f"k{i % 5}", i // 5) for i in range(20)], clock)
    broker = FailingTransportDouble(SqlTransport(engine))
    broker.down = True
    relay = Relay(engine, broker, RelayConfig(backoff_base=1.0, max_retries=2), clock=clock)

    for _ in range(6):  # the outage outlasts the whole retry budget...
        relay.run_once()
        clock.advance(300)
    rows = outbox_rows(engine)
    assert {r.status for r in rows.values()} == {PENDING}  # ...and spends none of it
    assert {r.retry_count for r in rows.values()} == {0}
    assert {rows[m.message_id].last_error for m in messages[:5]} == {"broker unreachable (double)"}
    assert count(engine, schema.transport_messages) == 0

    broker.down = False
    drain(relay)
    assert {r.status for r in outbox_rows(engine).values()} == {SENT}
    with engine.connect() as conn:
        delivered = conn.execute(
            sa.select(schema.transport_messages.c.message_id).order_by(
                schema.transport_messages.c.id
            )
        ).scalars()
        delivered_ids = list(delivered)
    assert sorted(delivered_ids) == sorted(m.message_id for m in messages)  # each exactly once
    position = {message_id: i for i, message_id in enumerate(delivered_ids)}
    for key in range(5):
        of_key = [m.message_id for m in messages if m.partition_key == f"k{key}"]
        assert sorted(of_key, key=position.__getitem__) == of_key


# -- 4. per-key order under several relays and random failures ----------------------------------


@pytest.mark.parametrize("strategy", ["auto", "optimistic"])
def test_per_key_order_holds_under_four_relays_and_random_failures(
    db_url: str, engines: list[object], strategy: str
) -> None:
    # On SQLite "auto" is the optimistic claim, so both parameters run the same path there.
    engine = make_engine(db_url, engines, pool_size=6)
    keys, per_key = 30, 6
    messages = write(engine, [envelope(f"k{i % keys}", i // keys) for i in range(keys * per_key)])
    order = {m.message_id: (m.partition_key, m.payload["n"]) for m in messages}
    broker = RandomFailureTransportDouble(order, rate=0.2, seed=4)
    config = RelayConfig(
        batch_size=16,
        backoff_base=0.002,
        backoff_cap=0.02,
        jitter=0.5,
        max_retries=1000,
        claim=strategy,
    )
    relays = [Relay(engine, broker, config) for _ in range(4)]
    done = threading.Event()
    errors: list[BaseException] = []

    def work(relay: Relay) -> None:
        try:
            while not done.is_set():
                if relay.run_once().claimed == 0:
                    time.sleep(0.002)
        except BaseException as error:
            errors.append(error)
            done.set()

    threads = [threading.Thread(target=work, args=(relay,)) for relay in relays]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while count(engine, t, t.c.status != SENT) and time.monotonic() < deadline and not errors:
        time.sleep(0.05)
    done.set()
    for thread in threads:
        thread.join(10)

    assert errors == []
    assert broker.violations == []
    assert sum(1 for _, ok in broker.attempts if not ok) > 20  # retries really happened
    acked = [message_id for message_id, ok in broker.attempts if ok]
    assert sorted(acked) == sorted(order)  # every message acknowledged exactly once
    first_attempts: dict[str, list[int]] = defaultdict(list)
    for message_id in dict.fromkeys(m for m, _ in broker.attempts):
        key, n = order[message_id]
        first_attempts[key].append(n)
    assert all(ns == list(range(per_key)) for ns in first_attempts.values())
    assert sum(r.stats.published for r in relays) == len(messages)
    assert sum(1 for r in relays if r.stats.published) >= 2


# -- 6. optimistic claims and leases ------------------------------------------------------------


@pytest.mark.mariadb
def test_optimistic_claims_never_share_a_row(mariadb_url: str, engines: list[object]) -> None:
    engine = make_engine(mariadb_url, engines, pool_size=8)
    clock = ClockDouble()
    write(engine, [envelope(f"k{i}") for i in range(100)], clock)
    strategy = claims.OptimisticClaim(timedelta(seconds=30))
    assert claims.strategy_for(engine, "optimistic").name == "optimistic"

    with strategy.claim(engine, 40, clock.now()) as a, strategy.claim(engine, 40, clock.now()) as b:
        with engine.connect() as conn:
            owners = dict(conn.execute(sa.select(t.c.id, t.c.claimed_by)).all())
        assert {owners[r.id] for r in a.rows} == {a.token}
        assert {owners[r.id] for r in b.rows} == {b.token}
        assert len(a.rows) == len(b.rows) == 40 and not {r.id for r in a.rows} & {
            r.id for r in b.rows
        }
    # Unmarked rows stay leased: nobody takes them until the lease runs out...
    with strategy.claim(engine, 100, clock.now()) as c:
        assert len(c.rows) == 20
    with strategy.claim(engine, 100, clock.now() + timedelta(seconds=29)) as d:
        assert d.rows == []
    # ...and then anyone may.
    with strategy.claim(engine, 100, clock.now() + timedelta(seconds=31)) as e:
        assert len(e.rows) == 100

    # Four claimers racing for the same rows, released at the same instant, again and again.
    for round_ in range(5):
        now = clock.now() + timedelta(minutes=round_ + 2)  # every earlier lease has run out
        taken = race_claims(engine, strategy, now, claimers=4, limit=60)
        flat = [row_id for ids in taken for row_id in ids]
        assert flat and len(flat) == len(set(flat)), taken  # no row has two owners


def race_claims(
    engine: sa.Engine, strategy: claims.ClaimStrategy, now: datetime, claimers: int, limit: int
) -> list[list[int]]:
    barrier = threading.Barrier(claimers)
    taken: list[list[int]] = [[] for _ in range(claimers)]

    def take(slot: int) -> None:
        barrier.wait()
        with strategy.claim(engine, limit, now) as claim:
            taken[slot] = [r.id for r in claim.rows]

    threads = [threading.Thread(target=take, args=(i,)) for i in range(claimers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return taken


def test_an_expired_lease_is_reclaimed_and_the_old_owner_cannot_mark(
    db_url: str, engines: list[object]
) -> None:
    engine = make_engine(db_url, engines)
    clock = ClockDouble()
    messages = write(engine, [envelope(f"k{i}") for i in range(3)], clock)
    config = RelayConfig(claim="optimistic", lease_seconds=30, backoff_base=5)
    thief_transport = FailingTransportDouble()
    thief_transport.failing = {m.message_id for m in messages}
    thief = Relay(engine, thief_transport, config, clock=clock)
    slow = FailingTransportDouble()
    stolen: list[BatchOutcome] = []

    def stall(_: Sequence[OutgoingMessage]) -> None:
        # While the slow relay publishes, its lease runs out and another relay takes the rows.
        leases = {(r.claimed_by is not None, r.lease_until) for r in outbox_rows(engine).values()}
        assert leases == {(True, START + timedelta(seconds=30))}
        clock.advance(31)
        stolen.append(thief.run_once())

    slow.on_publish = stall
    owner = Relay(engine, slow, config, clock=clock)
    assert owner.run_once().published == 0  # its marks hit rows it no longer owns
    assert stolen == [BatchOutcome(published=0, retried=3, failed=0, claimed=3)]
    # The thief's record of its failed attempt survives; the rows come again (at least once).
    assert {(r.status, r.retry_count) for r in outbox_rows(engine).values()} == {(PENDING, 1)}
    thief_transport.failing.clear()
    clock.advance(60)
    assert thief.run_once().published == 3
    assert {r.status for r in outbox_rows(engine).values()} == {SENT}


# -- 7. SQLite: one file, one writer at a time --------------------------------------------------


@pytest.mark.sqlite
def test_sqlite_writer_and_relay_share_one_file(sqlite_url: str, engines: list[object]) -> None:
    app = make_engine(sqlite_url, engines)
    relay_engine = make_engine(sqlite_url, engines, pool_size=2)
    relay = Relay(relay_engine, SqlTransport(relay_engine), RelayConfig(poll_interval=0.01))
    assert relay.strategy.name == "optimistic"
    orders = sa.Table("orders", sa.MetaData(), sa.Column("id", sa.String(36), primary_key=True))
    orders.metadata.create_all(app)
    relay.start()
    try:
        writer = OutboxWriter()
        for i in range(200):
            with app.begin() as conn:
                conn.execute(orders.insert(), {"id": f"o{i}"})
                writer.add(conn, envelope(f"o{i}"))
        deadline = time.monotonic() + 30
        while count(app, t, t.c.status == SENT) < 200 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        relay.stop()
    assert count(app, t, t.c.status == SENT) == 200
    q = schema.transport_messages
    with app.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count(sa.distinct(q.c.message_id)))) == 200
    assert count(app, q) == 200 and count(app, orders) == 200
    assert relay.stats.errors == 0


# -- 11. NOTIFY wake-ups on PostgreSQL ----------------------------------------------------------


def _listener_pid(engine: sa.Engine, other_than: int | None = None) -> int | None:
    with engine.connect() as conn:
        return conn.scalar(
            sa.text(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name = 'saga-engine-listen' AND pid <> :other"
            ),
            {"other": other_than or 0},
        )


def _delivery_latency(engine: sa.Engine, key: str) -> float:
    message = envelope(key)
    started = time.perf_counter()
    write(engine, [message])
    while not delivered(engine, message.message_id):
        assert time.perf_counter() - started < 4, "not woken: delivered only by polling"
        time.sleep(0.005)
    return time.perf_counter() - started


def _wait_for(predicate: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


@pytest.mark.postgres
def test_notify_wakes_the_relay_and_survives_a_killed_listener(
    pg_url: str, engines: list[object]
) -> None:
    engine = make_engine(pg_url, engines)
    relay = Relay.for_database(pg_url, SqlTransport(engine), RelayConfig(poll_interval=5.0))
    engines.append(relay.engine)
    relay.start()
    try:
        first_pid = _wait_for(lambda: _listener_pid(engine), 5)
        time.sleep(0.2)  # let the wake-up that follows every (re)connect pass
        before = [_delivery_latency(engine, f"before-{i}") for i in range(3)]

        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first_pid})
        _wait_for(lambda: _listener_pid(engine, other_than=first_pid), 10)
        time.sleep(0.2)
        after = [_delivery_latency(engine, f"after-{i}") for i in range(3)]
    finally:
        relay.stop()
    print(f"NOTIFY delivery latency: before {before}, after reconnect {after}")
    assert max(before + after) < 1.0
    assert relay.stats.errors == 0


@pytest.mark.postgres
def test_notifies_that_come_while_a_wake_up_is_pending_are_read_as_one(
    pg_url: str, engines: list[object]
) -> None:
    """The listener leaves the socket alone while its wake-up waits to be taken: thirty commits
    that come meanwhile are read at once after it is taken, and wake the relay once, not thirty
    times."""
    engine = make_engine(pg_url, engines)
    wakeup = relay_wakeup(engine)
    wakeup.start()
    try:
        _wait_for(lambda: _listener_pid(engine), 5)
        assert wakeup.wait(5.0)  # the wake-up that follows every LISTEN
        with engine.connect() as conn:
            conn.execute(sa.text("NOTIFY saga_engine_outbox"))
            conn.commit()
            time.sleep(0.3)  # the listener has read it and set the wake-up
            for _ in range(30):
                conn.execute(sa.text("NOTIFY saga_engine_outbox"))
                conn.commit()
        time.sleep(0.3)
        assert wakeup.wait(0.05)  # the first one
        # The thirty were not read while the first was pending (else they would have folded
        # into it): they wake the relay now, once.
        assert wakeup.wait(2.0)
        assert not wakeup.wait(0.3)
    finally:
        wakeup.stop()


# -- 12. Of several listening relays, one leads -------------------------------------------------


@contextlib.contextmanager
def _listening_relays(
    pg_url: str, engine: sa.Engine, engines: list[object], n: int
) -> Iterator[list[Relay]]:
    """``n`` relays as ``saga-engine relay`` makes them, polling every 5 s only (so a message
    delivered sooner was delivered for a wake-up), started and listening; stopped afterwards."""
    relays = [
        Relay.for_database(pg_url, SqlTransport(engine), RelayConfig(poll_interval=5.0))
        for _ in range(n)
    ]
    try:
        for relay in relays:
            engines.append(relay.engine)
            relay.start()
        _wait_for(lambda: _listeners(engine) == n, 5)
        time.sleep(0.3)  # the wake-up that follows each LISTEN has passed
        yield relays
    finally:
        for relay in relays:
            relay.stop()


def _listeners(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name = 'saga-engine-listen'"
                )
            )
        )


def _follows(relay: Relay) -> bool:
    return relay.wakeup is not None and relay.wakeup.follower


def _followers(relays: Sequence[Relay]) -> list[bool]:
    return [_follows(relay) for relay in relays]


@pytest.mark.postgres
def test_of_two_listening_relays_the_leader_passes_for_every_wake_up(
    pg_url: str, engines: list[object]
) -> None:
    engine = make_engine(pg_url, engines)
    with _listening_relays(pg_url, engine, engines, 2) as relays:
        assert sorted(_followers(relays)) == [False, True]
        leader, follower = sorted(relays, key=_follows)
        latencies = [_delivery_latency(engine, f"lead-{i}") for i in range(12)]
    print(f"latencies {[round(x, 3) for x in latencies]}; follower {follower.stats}")
    assert max(latencies) < 1.0  # far inside the poll interval: woken, not polled
    assert (leader.stats.published, follower.stats.published) == (12, 0)
    # The follower does not listen: the 12 commits woke only the leader.
    assert follower.stats.wakeups_left_to_leader == 0
    assert leader.stats.wakeups_left_to_leader == 0


@pytest.mark.postgres
def test_the_lead_passes_on_when_the_leader_stops_or_loses_its_listener(
    pg_url: str, engines: list[object]
) -> None:
    engine = make_engine(pg_url, engines)
    with _listening_relays(pg_url, engine, engines, 3) as relays:
        leader = next(relay for relay in relays if not _follows(relay))
        leader.stop()
        rest = [relay for relay in relays if relay is not leader]
        # A follower tries for the lead at each liveness probe (1 s).
        _wait_for(lambda: sorted(_followers(rest)) == [False, True], 5)
        assert max(_delivery_latency(engine, f"after-stop-{i}") for i in range(3)) < 1.0

        new_leader = next(relay for relay in rest if not _follows(relay))
        with engine.connect() as conn:
            pids = conn.scalars(
                sa.text(
                    "SELECT l.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
                    "WHERE l.locktype = 'advisory' AND l.granted "
                    "AND a.datname = current_database() "
                    "AND a.application_name = 'saga-engine-listen'"
                )
            ).all()
            assert len(pids) == 1  # the lead is one listener's session lock
            assert conn.scalar(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pids[0]})
        # Whichever listener gets there first leads; never both, never neither for long.
        _wait_for(lambda: _listeners(engine) == 2 and sorted(_followers(rest)) == [False, True], 5)
        assert max(_delivery_latency(engine, f"after-kill-{i}") for i in range(3)) < 1.0
        assert new_leader.stats.errors == 0


@pytest.mark.postgres
def test_a_listener_of_a_database_without_an_outbox_yet_neither_leads_nor_follows(
    tmp_path: Path, engines: list[object]
) -> None:
    """A relay may start before the migrations ran: its listener listens and leaves the lead
    for when the outbox exists."""
    with fresh_database("postgres", tmp_path, create_schema=False) as url:
        engine = make_engine(url, engines)
        wakeup = relay_wakeup(engine)
        wakeup.start()
        try:
            _wait_for(lambda: _listeners(engine) == 1, 5)
            time.sleep(1.5)  # a liveness probe, which tries for the lead again, has run
            assert wakeup.follower is False and _listeners(engine) == 1  # never reconnected
            schema.metadata.create_all(engine)
            other = relay_wakeup(engine)
            other.start()
            try:
                # The first listener tries again at its next probe, and one of the two leads.
                _wait_for(lambda: sorted([wakeup.follower, other.follower]) == [False, True], 5)
            finally:
                other.stop()
        finally:
            wakeup.stop()


@pytest.mark.postgres
def test_a_listener_that_tries_for_the_lead_has_the_server_drop_a_vanished_host_soon(
    pg_url: str, engines: list[object]
) -> None:
    import psycopg

    engine = make_engine(pg_url, engines)
    wakeup = relay_wakeup(engine)
    assert wakeup.conninfo is not None
    with psycopg.connect(wakeup.conninfo, autocommit=True) as conn:
        wakeup._try_lead_then_listen(conn, first=True)
        assert wakeup.follower is False  # nobody else holds it: this one leads
        shown = [
            conn.execute(f"SHOW {name}").fetchone()[0]  # type: ignore[index]
            for name in ("tcp_keepalives_idle", "tcp_keepalives_count", "tcp_user_timeout")
        ]
    assert shown == ["10", "3", "30000"]
