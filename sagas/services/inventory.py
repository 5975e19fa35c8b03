"""The inventory service: stock per SKU, and the reservations orders hold on it.

Every stock change is a conditional ``UPDATE`` (``WHERE available >= quantity``), so concurrent
reservations can never oversell, and every reservation is keyed by its order: a command delivered
twice finds the reservation already there and answers the same way again.
"""

from __future__ import annotations

import enum

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from saga_engine import errors
from saga_engine.messages import Message
from saga_engine.participant import Participant
from sagas.services import rowcount

metadata = sa.MetaData()

stock = sa.Table(
    "inventory_stock",
    metadata,
    sa.Column("sku", sa.String(64), primary_key=True),
    sa.Column("total", sa.Integer, nullable=False),
    sa.Column("available", sa.Integer, nullable=False),
    sa.Column("reserved", sa.Integer, nullable=False),
    sa.CheckConstraint("available >= 0 AND reserved >= 0", name="inventory_stock_not_negative"),
)

reservations = sa.Table(
    "inventory_reservations",
    metadata,
    sa.Column("order_id", sa.String(36), primary_key=True),  # one reservation per order
    sa.Column("status", sa.String(16), nullable=False),
)

reservation_lines = sa.Table(
    "inventory_reservation_lines",
    metadata,
    sa.Column("order_id", sa.ForeignKey(reservations.c.order_id), primary_key=True),
    sa.Column("sku", sa.String(64), primary_key=True),
    sa.Column("quantity", sa.Integer, nullable=False),
)


class ReservationStatus(enum.StrEnum):
    RESERVED = "RESERVED"
    RELEASED = "RELEASED"


class Line(BaseModel):
    """A quantity of one SKU."""

    model_config = ConfigDict(frozen=True)

    sku: str = Field(min_length=1, max_length=64)
    quantity: int = Field(gt=0)


class ReserveStock(Message):
    order_id: str
    lines: tuple[Line, ...]


class StockReserved(Message):
    order_id: str


class ReleaseStock(Message):
    order_id: str


service = Participant("inventory", metadata=metadata)


@service.handles(ReserveStock)
def reserve_stock(cmd: ReserveStock, tx: Session) -> StockReserved:
    status = reservation_status(tx, cmd.order_id)
    if status is ReservationStatus.RESERVED:
        return StockReserved(order_id=cmd.order_id)  # reserved before: the same answer again
    if status is ReservationStatus.RELEASED:
        raise errors.Rejected("the order was cancelled before its stock was reserved")
    # The reservation row first: a concurrent duplicate fails on its key and is retried.
    tx.execute(
        reservations.insert(), {"order_id": cmd.order_id, "status": ReservationStatus.RESERVED}
    )
    # Take rows in SKU order, so two orders sharing SKUs cannot deadlock on each other.
    for line in sorted(cmd.lines, key=lambda x: x.sku):
        if not take(tx, line):
            raise errors.Rejected(f"out of stock: {line.sku}")  # rolls back every line
    tx.execute(
        reservation_lines.insert(),
        [{"order_id": cmd.order_id, "sku": x.sku, "quantity": x.quantity} for x in cmd.lines],
    )
    return StockReserved(order_id=cmd.order_id)


@service.handles(ReleaseStock)
def release_stock(cmd: ReleaseStock, tx: Session) -> None:
    """Idempotent: releasing twice, or releasing an order never reserved, changes nothing."""
    status = reservation_status(tx, cmd.order_id)
    if status is None:
        # Nothing reserved (yet). Remember the release, so a ReserveStock that arrives late is
        # refused instead of reserving stock for an order that is already cancelled.
        tx.execute(
            reservations.insert(), {"order_id": cmd.order_id, "status": ReservationStatus.RELEASED}
        )
        return
    released = rowcount(
        tx.execute(
            sa.update(reservations)
            .where(
                reservations.c.order_id == cmd.order_id,
                reservations.c.status == ReservationStatus.RESERVED,
            )
            .values(status=ReservationStatus.RELEASED)
        )
    )
    if released != 1:
        return  # released before
    lines = tx.execute(
        sa.select(reservation_lines.c.sku, reservation_lines.c.quantity)
        .where(reservation_lines.c.order_id == cmd.order_id)
        .order_by(reservation_lines.c.sku)
    )
    for sku, quantity in lines.all():
        put_back(tx, sku, quantity)


def reservation_status(tx: Session, order_id: str) -> ReservationStatus | None:
    status = tx.scalar(sa.select(reservations.c.status).where(reservations.c.order_id == order_id))
    return None if status is None else ReservationStatus(status)


def take(tx: Session, line: Line) -> bool:
    """Move ``line.quantity`` from available to reserved, if that much is available."""
    taken = tx.execute(
        sa.update(stock)
        .where(stock.c.sku == line.sku, stock.c.available >= line.quantity)
        .values(
            available=stock.c.available - line.quantity,
            reserved=stock.c.reserved + line.quantity,
        )
    )
    return rowcount(taken) == 1


def put_back(tx: Session, sku: str, quantity: int) -> None:
    tx.execute(
        sa.update(stock)
        .where(stock.c.sku == sku)
        .values(available=stock.c.available + quantity, reserved=stock.c.reserved - quantity)
    )
