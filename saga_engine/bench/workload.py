"""The messages and business rows the relay and latency benchmarks write.

A message is an order event of a realistic size: an envelope routed by its order id with a JSON
payload of about ``payload_bytes`` (order id, customer, lines, amount, padding), the same shape
the order saga's commands have.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import Connection

from saga_engine import clock, db
from saga_engine.messages import Envelope

metadata = sa.MetaData()

#: The business table of the latency and write-overhead measurements.
bench_orders = sa.Table(
    "bench_orders",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
    sa.Column("order_id", sa.String(64), nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.DateTime, nullable=False),
)


def payload(order_id: str, size: int) -> dict[str, object]:
    """An order-like payload whose compact JSON is about ``size`` bytes."""
    body: dict[str, object] = {
        "order_id": order_id,
        "customer_id": "customer-0042",
        "lines": [{"sku": "SKU-TEA", "quantity": 2}, {"sku": "SKU-MUG", "quantity": 1}],
        "amount": 2100,
        "currency": "EUR",
        "note": "",
    }
    base = len(str(body).replace(" ", "")) + 2
    body["note"] = "x" * max(0, size - base)
    return body


def envelope(topic: str, key: str, payload_bytes: int) -> Envelope:
    """One order event for ``topic``, partitioned by the order ``key``."""
    return Envelope(
        message_type="OrderPlaced",
        destination=topic,
        partition_key=key,
        aggregate_type="order",
        aggregate_id=key,
        correlation_id=key,
        headers={"source": "bench"},
        payload=payload(key, payload_bytes),
    )


def order_key(index: int) -> str:
    """The order id of the ``index``-th aggregate of a run."""
    return f"order-{index:09d}"


#: The business insert as the driver's SQL, with no ``RETURNING`` of the new id: the bench's
#: writers share the machine with the relay they measure, so their transaction should cost what
#: an application's hot path costs, not what SQLAlchemy's generic path does (it fetches the new
#: primary key and sets up a result: about 0.2 ms of client CPU per transaction here).
_ORDER_INSERT = db.DriverStatement(bench_orders.insert(), ("order_id", "amount", "created_at"))


def insert_order(conn: Connection, order_id: str) -> None:
    """The business change of the latency bench's transaction: one row."""
    _ORDER_INSERT.execute(
        conn, {"order_id": order_id, "amount": 2100, "created_at": clock.SYSTEM.now()}
    )
