"""The relay's and writer's fast paths without servers: they must do exactly what the plain code did.

The wire bytes of ``to_outgoing`` are compared with ``messages.wire_bytes`` fed the fields the
straightforward way; the writer's rows with ``json.dumps``; the statements are compiled for each
dialect; the fixed-rate loop runs against a relay whose passes are stubbed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from saga_engine import db, schema, store
from saga_engine.messages import Envelope, wire_bytes
from saga_engine.outbox import OutboxWriter
from saga_engine.outbox import claim as claims
from saga_engine.outbox import relay as relays
from saga_engine.outbox import writer as writers
from saga_engine.outbox.claim import OutboxRow
from saga_engine.outbox.notify import Wakeup
from saga_engine.outbox.relay import BatchOutcome, PassResult, Relay, RelayConfig, to_outgoing
from saga_engine.transport.base import Consumer, OutgoingMessage, PublishResult, Transport
from saga_engine.transport.memory import MemoryTransport

NOW = datetime(2030, 1, 1, 12, 0, 0, 123456)


def row(**fields: Any) -> OutboxRow:
    values: dict[str, Any] = {
        "id": 7,
        "message_id": "m-1",
        "message_type": "OrderCreated",
        "destination": "orders.events",
        "partition_key": "o-1",
        "aggregate_type": "Order",
        "aggregate_id": "o-1",
        "correlation_id": None,
        "causation_id": None,
        "tenant_id": None,
        "headers": "{}",
        "payload": '{"n":1}',
        "retry_count": 0,
        "created_at": NOW,
    }
    values.update(fields)
    return OutboxRow(**values)


def reference_wire(r: Any) -> bytes:
    """The wire form built the plain way: a dict of the fields through ``wire_bytes``."""
    fields = {
        "message_id": r.message_id,
        "message_type": r.message_type,
        "destination": r.destination,
        "partition_key": r.partition_key,
        "aggregate_type": r.aggregate_type,
        "aggregate_id": r.aggregate_id,
        "correlation_id": r.correlation_id,
        "causation_id": r.causation_id,
        "tenant_id": r.tenant_id,
        "created_at": r.created_at.replace(tzinfo=UTC).isoformat(),
    }
    return wire_bytes(fields, r.headers, r.payload)


# -- to_outgoing: byte for byte what the envelope encoder gives ---------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"correlation_id": "saga-1", "causation_id": "m-0", "tenant_id": "acme"},
        {"partition_key": 'quote " backslash \\ tab \t nl \n nul \x00', "aggregate_id": ""},
        {"message_type": "Grüße 订单 \u2028 😀", "destination": "d/é"},
        {"headers": '{"traceparent":"00-abc-01"}', "payload": '{"note":"Grüße","x":[1,2.5,null]}'},
        {"created_at": datetime(2030, 1, 1, 12, 0, 0)},  # no microseconds: isoformat omits them
        {"created_at": datetime(2030, 1, 1, 12, 0, 0, 5, tzinfo=UTC)},
        {"created_at": datetime(2030, 1, 1, 12, 0, 0, tzinfo=timezone(timedelta(hours=2)))},
        {"tenant_id": 42},  # not text (a database may return anything): the encoder's answer
    ],
)
def test_to_outgoing_gives_the_envelope_encoders_bytes(fields: dict[str, Any]) -> None:
    r = row(**fields)
    outgoing = to_outgoing(r)
    assert outgoing.value == reference_wire(r)
    assert (outgoing.message_id, outgoing.destination, outgoing.partition_key) == (
        r.message_id,
        r.destination,
        r.partition_key,
    )
    if not isinstance(r.tenant_id, int):
        assert Envelope.from_wire(outgoing.value).created_at.utcoffset() is not None


def test_to_outgoing_takes_result_rows_of_any_outbox_columns(memory_db: sa.Engine) -> None:
    envelope = Envelope(
        message_type="T",
        destination="d",
        partition_key="k",
        tenant_id="t",
        headers={"h": "ü"},
        payload={"x": "é"},
    )
    with memory_db.begin() as conn:
        OutboxWriter().add(conn, envelope)
        claimed = conn.execute(sa.select(*claims.ROW_COLUMNS)).one()
        whole = conn.execute(sa.select(schema.outbox)).one()  # every column, another order
    expected = reference_wire(claimed)
    assert to_outgoing(claimed).value == expected
    assert to_outgoing(whole).value == expected
    assert to_outgoing(claims.outbox_row(whole)).value == expected


def test_outbox_row_fields_are_the_row_columns_in_order() -> None:
    assert OutboxRow._fields == tuple(column.name for column in claims.ROW_COLUMNS)


# -- the statements: arrays on PostgreSQL, IN lists elsewhere, status as a literal ---------------


def pg_dialect() -> sa.Dialect:
    return postgresql.psycopg.dialect()  # type: ignore[no-untyped-call]


def sql_of(statement: sa.ClauseElement, dialect: sa.Dialect) -> str:
    return " ".join(str(statement.compile(dialect=dialect)).split())


def test_postgresql_binds_id_and_key_lists_as_arrays() -> None:
    dialect = pg_dialect()
    built = claims.Statements.build(array=True)
    guard = sql_of(built.guard, dialect)
    assert "partition_key = ANY (%(keys)s::VARCHAR(255)[])" in guard
    assert "NOT (outbox_messages.id = ANY (%(ids)s::BIGINT[]))" in guard
    for statement in (built.lock, built.release, built.take, built.lease):
        assert "outbox_messages.id = ANY (%(ids)s::BIGINT[])" in sql_of(statement, dialect)
    marks = relays._MARKS["postgresql", False]
    assert "WHERE outbox_messages.id = ANY (%(ids)s::BIGINT[])" in sql_of(marks.sent, dialect)
    owned = sql_of(relays._MARKS["postgresql", True].sent, dialect)
    assert "AND outbox_messages.claimed_by = %(token)s::VARCHAR" in owned


@pytest.mark.parametrize("dialect", [mysql.pymysql.dialect(), sqlite.dialect()])
def test_other_servers_keep_expanding_in_lists(dialect: sa.Dialect) -> None:
    built = claims.Statements.build(array=False)
    guard = sql_of(built.guard, dialect)
    assert "partition_key IN (__[POSTCOMPILE_keys])" in guard
    assert "id NOT IN (__[POSTCOMPILE_ids])" in guard
    for statement in (built.lock, built.release, built.take, built.lease):
        assert "ANY" not in sql_of(statement, dialect)
    assert "IN (__[POSTCOMPILE_ids])" in sql_of(relays._MARKS["other", False].sent, dialect)


def test_locking_reads_go_through_the_primary_key_on_mysql() -> None:
    """Through a secondary index InnoDB would lock its entries out of id order: deadlocks."""
    built = claims.Statements.build(array=False)
    for statement in (built.take, built.lock):
        assert "FROM outbox_messages FORCE INDEX (PRIMARY) WHERE" in sql_of(
            statement, mysql.pymysql.dialect()
        )
        assert "FORCE" not in sql_of(statement, sqlite.dialect())
    for update in (built.lease, built.release, relays._MARKS["mysql", False].sent):
        assert "UPDATE outbox_messages FORCE INDEX (PRIMARY) SET" in sql_of(
            update, mysql.pymysql.dialect()
        )
        assert "FORCE" not in sql_of(update, sqlite.dialect())


@pytest.mark.parametrize("owned", [False, True])
def test_deletes_of_acknowledged_rows_take_one_row_by_primary_key_on_mysql(owned: bool) -> None:
    """A DELETE of a list of ids may read rows other relays hold, and wait for them: deadlocks."""
    mine = " AND outbox_messages.claimed_by = %s" if owned else ""
    marks = relays._MARKS["mysql", owned]
    assert marks.delete_per_row and marks.archived[-1] is marks.deleted
    assert sql_of(marks.deleted, mysql.pymysql.dialect()) == (
        f"DELETE FROM outbox_messages WHERE outbox_messages.id = %s{mine}"
    )
    other = relays._MARKS["other", owned]
    assert not other.delete_per_row and "IN (" in sql_of(other.deleted, sqlite.dialect())


def test_cleanup_deletes_one_row_by_primary_key_on_mysql() -> None:
    from saga_engine.outbox import cleanup

    assert sql_of(claims.delete_by_primary_key(owned=False), mysql.pymysql.dialect()) == (
        "DELETE FROM outbox_messages WHERE outbox_messages.id = %s"
    )

    class ConnectionDouble:  # records what cleanup sends to a MariaDB connection
        dialect = mysql.pymysql.dialect()
        calls: list[tuple[object, object]] = []

        def execute(self, statement: object, params: list[dict[str, object]]) -> Any:
            self.calls.append((statement, params))
            return type("Result", (), {"rowcount": len(params)})()

    conn = ConnectionDouble()
    assert cleanup._delete(conn, [7, 9]) == 2  # type: ignore[arg-type]
    rows = [{"id": 7, "token": None}, {"id": 9, "token": None}]
    assert conn.calls == [(claims.delete_by_primary_key(owned=False), rows)]  # one executemany


def test_the_claim_compares_status_with_the_partial_index_literal() -> None:
    """A parameter for the status would keep a prepared (generic) plan off the partial index."""
    dialect = pg_dialect()
    claim = sql_of(claims.Statements.build(array=True).claim, dialect)
    assert claim.count("outbox_messages.status = 0") == 2  # the rows and the backoff subquery
    assert "LIMIT %(limit)s::INTEGER FOR UPDATE SKIP LOCKED" in claim


# -- the writer: the same row as before, the fastest way the dialect allows ---------------------


def test_the_writer_stores_what_json_dumps_gives(memory_db: sa.Engine) -> None:
    envelope = Envelope(
        message_type="T",
        destination="d",
        partition_key="k",
        headers={"trace": "é\u2028"},
        payload={"note": "Grüße, 订单", "n": [1, 2.5, None], "nested": {"a": True}},
    )
    with memory_db.begin() as conn:
        OutboxWriter().add_many(conn, [envelope, envelope.model_copy(update={"message_id": "m2"})])
        stored = conn.execute(sa.select(schema.outbox).order_by(schema.outbox.c.id)).all()
    assert [r.payload for r in stored] == [
        json.dumps(envelope.payload, separators=(",", ":"), ensure_ascii=False)
    ] * 2
    assert stored[0].headers == json.dumps(envelope.headers, separators=(",", ":"))
    assert OutboxWriter()._row(envelope.model_copy(update={"headers": {}}), NOW)["headers"] == "{}"
    assert (stored[0].status, stored[0].retry_count) == (schema.OutboxStatus.PENDING, 0)


def test_the_writer_goes_to_the_driver_where_no_value_needs_converting() -> None:
    # The paramstyles ``create_engine`` takes from these drivers.
    for dialect in (
        pg_dialect(),
        mysql.pymysql.dialect(paramstyle="pyformat"),
    ):
        sql = writers._DRIVER_INSERT._compile(dialect)
        assert sql is not None and sql.startswith("INSERT INTO outbox_messages (message_id,")
        assert "RETURNING" not in sql and "%(updated_at)s" in sql
    assert writers._DRIVER_INSERT._compile(sqlite.dialect()) is None  # datetimes become text there
    positional = mysql.pymysql.dialect(paramstyle="format")
    assert writers._DRIVER_INSERT._compile(positional) is None  # the rows are dicts


def test_the_saga_store_goes_to_the_driver_where_no_value_needs_converting() -> None:
    pg, my = pg_dialect(), mysql.pymysql.dialect(paramstyle="pyformat")
    for dialect in (pg, my):
        insert = store._INSERT._compile(dialect)
        assert insert is not None and insert.startswith("INSERT INTO saga_instances (id,")
        assert "RETURNING" not in insert
        save = store._SAVE._compile(dialect)
        assert save is not None and save.startswith("UPDATE saga_instances SET saga_type=")
        assert "%(b_id)s" in save and "%(b_read_version)s" in save and "created_at" not in save
    assert store._INSERT._compile(sqlite.dialect()) is None
    assert store._SAVE._compile(sqlite.dialect()) is None


def test_a_statement_whose_parameters_differ_from_its_keys_stays_compiled() -> None:
    t = schema.saga_instances
    update = sa.update(t).where(t.c.id == sa.bindparam("b_id"))
    # A key the statement does not bind, and a bound name no row would pass.
    assert db.DriverStatement(update, ["state", "b_id", "extra"])._compile(pg_dialect()) is None
    assert db.DriverStatement(update, ["state"])._compile(pg_dialect()) is None
    assert db.DriverStatement(update, ["state", "b_id"])._compile(pg_dialect()) is not None


# -- waves: per-key order when the transport reports per message --------------------------------


class RecordingTransportDouble(Transport):
    """Acknowledges everything but the message ids in ``failing``; records each call."""

    name = "recording-double"

    def __init__(self, failing: set[str]) -> None:
        self.failing = failing
        self.calls: list[list[str]] = []

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        self.calls.append([m.message_id for m in messages])
        return [
            PublishResult(m.message_id, "no" if m.message_id in self.failing else None)
            for m in messages
        ]

    def consumer(self, group: str, channels: Sequence[str]) -> Consumer:
        raise NotImplementedError


def test_waves_hold_the_ith_row_of_each_key_and_drop_a_failed_key(memory_db: sa.Engine) -> None:
    rows = [
        row(id=i, message_id=f"{key}{n}", partition_key=key)
        for i, (key, n) in enumerate(
            [("a", 0), ("b", 0), ("a", 1), ("c", 0), ("b", 1), ("a", 2), ("b", 2), ("a", 3)]
        )
    ]
    transport = RecordingTransportDouble(failing={"b1"})
    relay = Relay(memory_db, transport)
    results, unsent = relay._publish_in_key_order(rows)
    assert transport.calls == [["a0", "b0", "c0"], ["a1", "b1"], ["a2"], ["a3"]]
    assert [r.message_id for r in results] == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert [r.message_id for r in unsent] == ["b2"]  # behind the failed b1, never attempted

    distinct = RecordingTransportDouble(failing=set())
    results, unsent = Relay(memory_db, distinct)._publish_in_key_order(rows[:2] + rows[3:4])
    assert distinct.calls == [["a0", "b0", "c0"]] and unsent == []


# -- fixed-rate polling --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("interval", "took", "expected"),
    [(0.5, 0.0, 0.5), (0.5, 0.2, 0.3), (0.5, 0.5, 0.0), (0.5, 3.0, 0.0), (2.0, 0.25, 1.75)],
)
def test_fixed_rate_sleep_is_the_rest_of_the_interval(
    interval: float, took: float, expected: float
) -> None:
    assert relays.fixed_rate_sleep(interval, took) == pytest.approx(expected)


class StubbedPassesRelay(Relay):
    """A relay whose passes take ``pass_seconds`` and end as ``results`` says, one per pass;
    records how long the loop sleeps after each, and stops when the results run out. Its sleeps
    end as ``woken`` says, one per sleep (by the timer once it runs out), and ``follower`` says
    whether another relay leads the wake-ups."""

    def __init__(self, engine: sa.Engine, results: list[PassResult], pass_seconds: float) -> None:
        super().__init__(engine, MemoryTransport(), RelayConfig(poll_interval=0.5))
        self.results = list(results)
        self.pass_seconds = pass_seconds
        self.sleeps: list[float] = []
        self.woken: list[bool] = []
        self.follower = False
        self.passes = 0
        self.limits: list[int | None] = []

    def _pass(self, limit: int | None = None) -> PassResult:
        self.passes += 1
        self.limits.append(limit)
        time.sleep(self.pass_seconds)
        result = self.results.pop(0)
        if not self.results:
            self._stop.set()
        return result

    def _sleep(self, stop: threading.Event, seconds: float) -> bool:
        self.sleeps.append(seconds)
        return self.woken.pop(0) if self.woken else False

    def _follows(self) -> bool:
        return self.follower


def test_the_loop_sleeps_the_interval_minus_the_polls_passes(memory_db: sa.Engine) -> None:
    results = [PassResult.PARTIAL, PassResult.FULL, PassResult.FULL, PassResult.PARTIAL]
    relay = StubbedPassesRelay(memory_db, results, pass_seconds=0.1)
    relay.run()
    assert relay.passes == 4
    assert len(relay.sleeps) == 2  # full batches go again at once
    # The second poll is three passes: the next one is due an interval after the first began,
    # not after the last (which would stretch every poll that finds a backlog by its passes).
    first, second = relay.sleeps
    assert 0.3 <= first <= 0.4 + 1e-9 and 0.1 <= second <= 0.2 + 1e-9, relay.sleeps


def test_a_poll_claims_the_oldest_few_first_and_twice_as_many_while_claims_are_full(
    memory_db: sa.Engine,
) -> None:
    full, partial = PassResult.FULL, PassResult.PARTIAL
    relay = StubbedPassesRelay(memory_db, [partial, full, full, full, full, partial, partial], 0.0)
    relay.config = RelayConfig(poll_interval=0.5, batch_size=500, first_poll_batch=100)
    relay.woken = [False, True]  # the poll timer ends the first sleep, a wake-up the second
    relay.run()
    # The first pass is a poll's too; after a wake-up the relay claims a whole batch.
    assert relay.limits == [100, 100, 200, 400, 500, 500, 500]


def test_a_poll_never_claims_more_than_the_batch_size(memory_db: sa.Engine) -> None:
    relay = StubbedPassesRelay(memory_db, [PassResult.FULL, PassResult.PARTIAL], 0.0)
    relay.config = RelayConfig(batch_size=50, first_poll_batch=100)
    relay.run()
    assert relay.limits == [50, 50]


def test_a_pass_longer_than_the_interval_is_followed_by_no_sleep(memory_db: sa.Engine) -> None:
    relay = StubbedPassesRelay(memory_db, [PassResult.PARTIAL], pass_seconds=0.0)
    relay.config = RelayConfig(poll_interval=0.001)
    relay.pass_seconds = 0.01
    relay.run()
    assert relay.sleeps == [0.0]


def test_a_follower_leaves_its_wake_ups_to_the_leader_and_passes_at_its_poll(
    memory_db: sa.Engine,
) -> None:
    relay = StubbedPassesRelay(memory_db, [PassResult.PARTIAL, PassResult.PARTIAL], 0.0)
    relay.follower, relay.woken = True, [True, True]
    relay.run()
    assert relay.passes == 2 and relay.stats.wakeups_left_to_leader == 2
    # Three sleeps before the second pass: two ended by wake-ups left to the leader, each
    # followed by the rest of the same interval, and the last ended by the poll timer.
    first, second, third, _ = relay.sleeps
    assert first == pytest.approx(0.5, abs=0.01) and first >= second >= third >= 0.45


def test_the_leader_passes_for_each_wake_up(memory_db: sa.Engine) -> None:
    relay = StubbedPassesRelay(memory_db, [PassResult.PARTIAL, PassResult.PARTIAL], 0.0)
    relay.woken = [True]
    relay.run()
    assert relay.passes == 2 and relay.stats.wakeups_left_to_leader == 0
    assert len(relay.sleeps) == 2


def test_a_failed_pass_waits_the_whole_interval(memory_db: sa.Engine) -> None:
    relay = StubbedPassesRelay(memory_db, [PassResult.FAILED], pass_seconds=0.05)
    relay.run()
    assert relay.sleeps == [0.5]


def test_pass_results(memory_db: sa.Engine) -> None:
    relay = Relay(memory_db, MemoryTransport(), RelayConfig(batch_size=2))
    outcomes = iter([BatchOutcome(0, 0, 0, 2), BatchOutcome(0, 0, 0, 1)])
    relay.run_once = lambda limit=None: next(outcomes)  # type: ignore[method-assign]
    assert [relay._pass(), relay._pass()] == [PassResult.FULL, PassResult.PARTIAL]

    def broken(limit: int | None = None) -> BatchOutcome:
        raise sa.exc.OperationalError("SELECT", {}, Exception("database went away"))

    relay.run_once = broken  # type: ignore[method-assign]
    assert relay._pass() is PassResult.FAILED and relay.stats.errors == 1


def test_a_wakeup_during_the_sleep_still_ends_it_early(memory_db: sa.Engine) -> None:
    """The fixed-rate sleep is still the NOTIFY wait: a notification cuts it short."""
    relay = Relay(memory_db, MemoryTransport(), RelayConfig(poll_interval=5.0))
    assert relay.wakeup is None
    relay.wakeup = Wakeup(None)
    timer = threading.Timer(0.05, relay.wakeup.notify)
    started = time.monotonic()
    timer.start()
    relay._sleep(threading.Event(), 5.0)
    assert time.monotonic() - started < 1.0
    timer.join()
