"""The outbox on each real database: atomic with the business change, relayed, consumed once."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from saga_engine import db, schema
from saga_engine.consumer import MessageConsumer
from saga_engine.messages import Envelope
from saga_engine.outbox import OutboxWriter
from saga_engine.outbox.relay import Relay, RelayConfig
from saga_engine.transport.sql import SqlTransport

orders = sa.Table("test_orders", sa.MetaData(), sa.Column("id", sa.String(36), primary_key=True))


def envelope(key: str, n: int = 0) -> Envelope:
    return Envelope(
        message_type="OrderCreated",
        destination="orders.events",
        partition_key=key,
        aggregate_type="Order",
        aggregate_id=key,
        payload={"order_id": key, "n": n},
    )


def setup(url: str, engines: list[object]) -> sa.Engine:
    engine = db.create_engine(url)
    engines.append(engine)
    orders.metadata.create_all(engine)
    return engine


def written_rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    """Every message written, in id order: the outbox's rows, and those the relay moved to the
    history (``on_sent="auto"`` archives on PostgreSQL and marks elsewhere)."""
    with engine.connect() as conn:
        rows = [
            *conn.execute(sa.select(*schema.outbox.c)),
            *conn.execute(sa.select(*schema.outbox_history.c)),
        ]
    return sorted(rows, key=lambda row: row.id)


def outbox_statuses(engine: sa.Engine) -> list[int]:
    return [row.status for row in written_rows(engine)]


def test_rollback_writes_no_message(db_url: str, engines: list[object]) -> None:
    engine = setup(db_url, engines)
    writer = OutboxWriter()
    try:
        with engine.begin() as conn:
            conn.execute(orders.insert(), {"id": "o-1"})
            writer.add(conn, envelope("o-1"))
            raise RuntimeError("business failure after the outbox write")
    except RuntimeError:
        pass
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(orders)) == 0
    assert outbox_statuses(engine) == []


def test_commit_delivers_and_inbox_absorbs_duplicates(db_url: str, engines: list[object]) -> None:
    engine = setup(db_url, engines)
    transport = SqlTransport(engine)
    with engine.begin() as conn:
        for i in range(5):
            conn.execute(orders.insert(), {"id": f"o-{i}"})
            OutboxWriter().add(conn, envelope(f"o-{i}", i))
    relay = Relay(engine, transport, RelayConfig(batch_size=3))
    assert relay.run_once().published == 3
    assert relay.run_once().published == 2
    assert outbox_statuses(engine) == [schema.OutboxStatus.SENT] * 5

    seen: list[str] = []
    consumer = MessageConsumer(
        "billing",
        engine,
        transport,
        ["orders.events"],
        lambda conn, env: seen.append(env.payload["order_id"]),
    )
    # Publish the same five again, as a relay would after a crash between publish and mark.
    from saga_engine.outbox.relay import to_outgoing

    transport.publish([to_outgoing(r) for r in written_rows(engine)], 5.0)
    while consumer.run_once():
        pass
    assert seen == [f"o-{i}" for i in range(5)]
    assert consumer.stats.duplicates == 5
    with engine.connect() as conn:
        assert consumer.inbox.duplicates(conn, "billing") == 5
    consumer.close()
