"""Idempotent consumption and dead letters on each real database, and the Redis dedupe store."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Connection

from saga_engine import db, deadletter, schema
from saga_engine.consumer import ConsumerConfig, MessageConsumer
from saga_engine.inbox import Inbox, RedisDedupe
from saga_engine.messages import Envelope
from saga_engine.transport.base import OutgoingMessage
from saga_engine.transport.sql import SqlTransport

ledger = sa.Table(
    "test_ledger",
    sa.MetaData(),
    sa.Column("message_id", sa.String(64), primary_key=True),
    sa.Column("amount", sa.Integer, nullable=False),
)
CHANNEL = "payments.commands"


def setup(url: str, engines: list[object]) -> sa.Engine:
    engine = db.create_engine(url)
    engines.append(engine)
    ledger.metadata.create_all(engine)
    return engine


def envelope(key: str = "order-1", amount: int = 10, **payload: Any) -> Envelope:
    return Envelope(
        message_type="ChargePayment",
        destination=CHANNEL,
        partition_key=key,
        payload={"order_id": key, "amount": amount, **payload},
    )


def publish(transport: SqlTransport, *items: Envelope | bytes, key: str = "k") -> None:
    """Put envelopes (or raw bytes, as a broken producer would) on the channel."""
    messages = []
    for i, item in enumerate(items):
        if isinstance(item, Envelope):
            messages.append(
                OutgoingMessage(item.message_id, CHANNEL, item.partition_key, item.to_wire())
            )
        else:
            messages.append(OutgoingMessage(f"raw-{i}", CHANNEL, key, item))
    assert all(r.ok for r in transport.publish(messages, 5.0))


def consumer_for(
    engine: sa.Engine,
    handler: Callable[[Connection, Envelope], None],
    **config: Any,
) -> MessageConsumer:
    settings = {"poll_timeout": 0.05, "retry_delay": 0.0, **config}
    return MessageConsumer(
        "billing",
        engine,
        SqlTransport(engine),
        [CHANNEL],
        handler,
        config=ConsumerConfig(**settings),
    )


def charge(conn: Connection, env: Envelope) -> None:
    conn.execute(ledger.insert(), {"message_id": env.message_id, "amount": env.payload["amount"]})


def drain(consumer: MessageConsumer, passes: int = 20) -> None:
    for _ in range(passes):
        if consumer.run_once() == 0:
            return
    raise AssertionError("consumer still busy")


def count(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(table)) or 0)


# -- 9. the unique-index inbox ------------------------------------------------------------------


def test_inbox_records_once_per_consumer_and_counts_duplicates(
    db_url: str, engines: list[object]
) -> None:
    engine = setup(db_url, engines)
    inbox = Inbox()
    with engine.begin() as conn:
        assert inbox.first_time(conn, "billing", "m-1") is True
    for _ in range(2):
        with engine.begin() as conn:
            assert inbox.first_time(conn, "billing", "m-1") is False
    with engine.begin() as conn:
        assert inbox.first_time(conn, "shipping", "m-1") is True  # each consumer has its own
    with engine.connect() as conn:
        assert inbox.duplicates(conn, "billing") == 2
        assert inbox.duplicates(conn, "shipping") == 0
        assert inbox.duplicates(conn) == 2
    assert count(engine, schema.inbox) == 2


def test_a_batch_is_recorded_in_one_go_with_a_flag_per_message_in_order(
    db_url: str, engines: list[object]
) -> None:
    engine = setup(db_url, engines)
    inbox = Inbox()
    with engine.begin() as conn:
        assert inbox.first_time(conn, "billing", "m-2")
    with engine.begin() as conn:
        # m-2 was recorded before; m-3 comes twice in the batch: new at its first place only.
        flags = inbox.first_times(conn, "billing", ["m-3", "m-2", "m-1", "m-3"])
    assert flags == [True, False, True, False]
    with engine.connect() as conn:
        assert inbox.duplicates(conn, "billing") == 2
    assert count(engine, schema.inbox) == 3


@pytest.mark.postgres
def test_on_postgresql_a_batch_of_any_size_is_one_statement_of_the_same_text(
    pg_url: str, engines: list[object]
) -> None:
    """The ids go as one array: the driver parses one text, not one per batch size."""
    engine = setup(pg_url, engines)
    sent: list[tuple[str, Any]] = []
    sa.event.listen(
        engine, "before_cursor_execute", lambda _c, _k, sql, params, *_: sent.append((sql, params))
    )
    inbox = Inbox()
    with engine.begin() as conn:
        assert inbox.first_times(conn, "billing", ["m-1"]) == [True]
        ids = [f"m-{n}" for n in range(50)]
        assert inbox.first_times(conn, "billing", ids) == [m != "m-1" for m in ids]
    inserts = [(sql, params) for sql, params in sent if "INSERT INTO inbox_messages" in sql]
    assert len(inserts) == 2
    assert inserts[0][0] == inserts[1][0]
    assert "unnest" in inserts[0][0]
    assert sorted(inserts[1][1]["keys"]) == sorted(ids)
    assert count(engine, schema.inbox) == 50


def test_a_duplicate_does_not_spoil_the_transaction_it_is_found_in(
    db_url: str, engines: list[object]
) -> None:
    """PostgreSQL aborts a transaction on a unique violation; the inbox must not cause one."""
    engine = setup(db_url, engines)
    inbox = Inbox()
    with engine.begin() as conn:
        assert inbox.first_time(conn, "billing", "m-1")
        assert not inbox.first_time(conn, "billing", "m-1")
        conn.execute(ledger.insert(), {"message_id": "m-1", "amount": 5})
    assert count(engine, ledger) == 1


def test_the_inbox_record_commits_and_rolls_back_with_the_handler(
    db_url: str, engines: list[object]
) -> None:
    engine = setup(db_url, engines)
    calls: list[str] = []

    def flaky_charge(conn: Connection, env: Envelope) -> None:
        charge(conn, env)  # the effect is written, then the handler fails
        calls.append(env.message_id)
        if len(calls) == 1:
            raise RuntimeError("payment provider timeout")

    consumer = consumer_for(engine, flaky_charge)
    try:
        message = envelope()
        publish(consumer.transport, message)  # type: ignore[arg-type]
        assert consumer.run_once() == 1
        # Rolled back together: no effect and no inbox record, and the message is still queued.
        assert (count(engine, ledger), count(engine, schema.inbox)) == (0, 0)
        assert count(engine, schema.transport_messages) == 1
        drain(consumer)
        assert calls == [message.message_id] * 2
        assert (count(engine, ledger), count(engine, schema.inbox)) == (1, 1)

        # The same message again (a relay that crashed before marking it): skipped and counted.
        publish(consumer.transport, message)  # type: ignore[arg-type]
        drain(consumer)
        assert len(calls) == 2 and count(engine, ledger) == 1
        assert consumer.stats.duplicates == 1
        assert count(engine, schema.inbox_duplicates) == 1
        assert count(engine, schema.transport_messages) == 0
    finally:
        consumer.close()


# -- 9b. Redis SET NX ---------------------------------------------------------------------------


@pytest.mark.redis
def test_redis_dedupe_sets_once_counts_duplicates_and_forgets(redis_url: str) -> None:
    dedupe = RedisDedupe.from_url(redis_url, ttl_seconds=60, prefix="test-dedupe")
    try:
        assert dedupe.first_time("billing", "m-1") is True
        assert dedupe.first_time("billing", "m-1") is False
        assert dedupe.first_time("billing", "m-1") is False
        assert dedupe.first_time("shipping", "m-1") is True
        assert dedupe.duplicates("billing") == 2
        assert dedupe.duplicates("shipping") == 0
        assert 0 < dedupe.client.ttl("test-dedupe:billing:m-1") <= 60  # type: ignore[attr-defined]

        dedupe.forget("billing", "m-1")  # the handler's transaction rolled back
        assert dedupe.first_time("billing", "m-1") is True
        assert dedupe.duplicates("billing") == 2
    finally:
        dedupe.client.close()  # type: ignore[attr-defined]


# -- 10. dead letters ---------------------------------------------------------------------------


def test_malformed_messages_are_dead_lettered_and_the_consumer_keeps_going(
    db_url: str, engines: list[object]
) -> None:
    engine = setup(db_url, engines)
    seen: list[str] = []
    consumer = consumer_for(
        engine, lambda conn, env: seen.append(env.message_id), max_message_bytes=2048
    )
    not_json = b"\xffnot json {"
    wrong_schema = json.dumps({"message_type": 42, "destination": CHANNEL}).encode()
    oversized = envelope(padding="x" * 4096).to_wire()
    good = envelope()
    try:
        publish(consumer.transport, not_json, wrong_schema, oversized, good)  # type: ignore[arg-type]
        drain(consumer)
    finally:
        consumer.close()

    assert seen == [good.message_id]
    with engine.connect() as conn:
        letters = conn.execute(
            sa.select(schema.dead_letters).order_by(schema.dead_letters.c.id)
        ).all()
    assert [bytes(d.raw) for d in letters] == [not_json, wrong_schema, oversized]
    assert {(d.consumer, d.channel) for d in letters} == {("billing", CHANNEL)}
    assert "Invalid JSON" in letters[0].reason
    assert "validation error" in letters[1].reason and "message_type" in letters[1].reason
    assert letters[2].reason == f"message of {len(oversized)} bytes exceeds 2048"
    assert deadletter.count(engine, "billing") == 3 == consumer.stats.dead_letters
    assert count(engine, schema.transport_messages) == 0  # all acknowledged: nothing comes again


def test_a_handler_that_always_fails_is_given_up_and_the_channel_moves_on(
    db_url: str, engines: list[object]
) -> None:
    engine = setup(db_url, engines)
    poison, same_key, other_key = envelope("o-1", 1), envelope("o-1", 2), envelope("o-2", 3)
    calls: list[str] = []

    def handler(conn: Connection, env: Envelope) -> None:
        calls.append(env.message_id)
        if env.message_id == poison.message_id:
            raise ValueError("card number is not a number")
        charge(conn, env)

    consumer = consumer_for(engine, handler, max_attempts=3)
    try:
        publish(consumer.transport, poison, same_key, other_key)  # type: ignore[arg-type]
        drain(consumer)
    finally:
        consumer.close()

    assert calls.count(poison.message_id) == 3  # exactly max_attempts runs
    with engine.connect() as conn:
        charged = set(conn.scalars(sa.select(ledger.c.message_id)))
        (letter,) = conn.execute(sa.select(schema.dead_letters)).all()
    assert charged == {same_key.message_id, other_key.message_id}
    assert calls.index(same_key.message_id) > max(
        i for i, m in enumerate(calls) if m == poison.message_id
    )  # the key's order held: its next message waited for the verdict on the poison one
    assert (letter.message_id, letter.message_type) == (poison.message_id, "ChargePayment")
    assert letter.reason == "gave up after 3 attempts: card number is not a number"
    assert Envelope.from_wire(bytes(letter.raw)) == poison
    assert (consumer.stats.retries, consumer.stats.given_up) == (2, 1)
    assert count(engine, schema.transport_messages) == 0


def test_a_consumer_with_a_long_name_leases_on_every_database(
    db_url: str, engines: list[object]
) -> None:
    """The SQL transport's lease names its consumer group; a long name must not overflow it."""
    engine = setup(db_url, engines)
    consumer = MessageConsumer(
        "participant:" + "warehouse_reservations" * 4,
        engine,
        SqlTransport(engine),
        [CHANNEL],
        charge,
        config=ConsumerConfig(poll_timeout=0.05, retry_delay=0.0),
    )
    try:
        publish(consumer.transport, envelope())  # type: ignore[arg-type]
        drain(consumer)
        assert count(engine, ledger) == 1
    finally:
        consumer.close()
