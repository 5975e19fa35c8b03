"""Order fulfilment: the saga of the outbox article (§6.3), as a team would write it.

This module is the order service. It owns the ``orders`` tables, runs the saga's local steps in its
own database, and orchestrates the other services:

    create_order        local: the order, PENDING          undo: cancel_order (CANCELLED)
    reserve_inventory   inventory: ReserveStock             undo: ReleaseStock
    charge_payment      payment: ChargePayment  (the pivot: once charged, only forward)
    award_points        loyalty: AwardPoints    (retried until it succeeds)
    approve_order       local: APPROVED

:func:`place_order` starts it. The saga's leading local step runs inside ``app.start``, so the
PENDING order, the saga instance and the ``ReserveStock`` command commit in ONE transaction: the
caller's. Below the saga are the demo's helpers: :func:`seed`, :func:`sample_order` (with
deterministic failures) and :func:`check_invariants`.
"""

from __future__ import annotations

import enum
import json
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Literal, TypedDict

import sqlalchemy as sa
from pydantic import BaseModel, Field, field_validator
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from saga_engine import schema
from saga_engine.app import App
from saga_engine.definition import Saga, step
from sagas.services import inventory, loyalty, payment

metadata = sa.MetaData()

orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("customer_id", sa.String(64), nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),  # minor units (cents)
    sa.Column("status", sa.String(16), nullable=False),
)

order_lines = sa.Table(
    "order_lines",
    metadata,
    sa.Column("order_id", sa.ForeignKey(orders.c.id), primary_key=True),
    sa.Column("sku", sa.String(64), primary_key=True),
    sa.Column("quantity", sa.Integer, nullable=False),
)


class OrderStatus(enum.StrEnum):
    PENDING = "PENDING"
    APPROVED = "APPROVED"
    CANCELLED = "CANCELLED"


class OrderData(BaseModel):
    """What the saga carries from step to step (stored with the saga instance, as JSON)."""

    order_id: str
    customer_id: str
    lines: tuple[inventory.Line, ...] = Field(min_length=1)
    amount: int = Field(gt=0)
    charge_id: str | None = None  # set when the payment service replies

    @field_validator("lines")
    @classmethod
    def one_line_per_sku(cls, lines: tuple[inventory.Line, ...]) -> tuple[inventory.Line, ...]:
        if len({line.sku for line in lines}) != len(lines):
            raise ValueError("each SKU may appear on one line only")
        return lines


CENTS_PER_POINT = 100  # one loyalty point per whole currency unit spent


# -- the local steps: transactions of the order service's own database ---------------------------


def create_order(data: OrderData, tx: Session) -> None:
    order = {"id": data.order_id, "customer_id": data.customer_id, "amount": data.amount}
    tx.execute(orders.insert(), {**order, "status": OrderStatus.PENDING})
    tx.execute(
        order_lines.insert(),
        [{"order_id": data.order_id, "sku": x.sku, "quantity": x.quantity} for x in data.lines],
    )


def cancel_order(data: OrderData, tx: Session) -> None:
    set_status(tx, data.order_id, OrderStatus.CANCELLED)


def approve_order(data: OrderData, tx: Session) -> None:
    set_status(tx, data.order_id, OrderStatus.APPROVED)


def set_status(tx: Session, order_id: str, status: OrderStatus) -> None:
    # Only a PENDING order moves (the article's business state machine): applied twice, the
    # second is a no-op, and a cancelled order can never become approved.
    tx.execute(
        sa.update(orders)
        .where(orders.c.id == order_id, orders.c.status == OrderStatus.PENDING)
        .values(status=status)
    )


# -- the commands: self-contained, so no service has to call back to learn what to do -----------


def reserve_for(data: OrderData) -> inventory.ReserveStock:
    return inventory.ReserveStock(order_id=data.order_id, lines=data.lines)


def release_for(data: OrderData) -> inventory.ReleaseStock:
    return inventory.ReleaseStock(order_id=data.order_id)


def charge_for(data: OrderData) -> payment.ChargePayment:
    return payment.ChargePayment(
        order_id=data.order_id, customer_id=data.customer_id, amount=data.amount
    )


def remember_charge(data: OrderData, reply: payment.PaymentCharged) -> OrderData:
    return data.model_copy(update={"charge_id": reply.charge_id})


def points_for(data: OrderData) -> loyalty.AwardPoints:
    return loyalty.AwardPoints(
        order_id=data.order_id, customer_id=data.customer_id, points=points_earned(data.amount)
    )


def points_earned(amount: int) -> int:
    return amount // CENTS_PER_POINT


order_fulfilment = Saga(
    "order_fulfilment",
    data=OrderData,
    steps=[
        step("create_order").local(create_order).compensate(cancel_order),
        (
            step("reserve_inventory")
            .invoke("inventory", reserve_for)
            .compensate("inventory", release_for)
        ),
        (
            step("charge_payment")
            .invoke("payment", charge_for, reply=payment.PaymentCharged)
            .on_reply(remember_charge)
            .pivot()
        ),
        step("award_points").invoke("loyalty", points_for).retriable(),
        step("approve_order").local(approve_order),
    ],
)


def place_order(
    app: App,
    session: Session,
    *,
    customer_id: str,
    lines: Sequence[inventory.Line],
    amount: int,
    order_id: str | None = None,
) -> str:
    """Open an order in the caller's transaction; returns its id (which is also the saga's id).

    Nothing leaves before the caller commits: the PENDING order row, the saga instance and the
    first command commit together, or not at all. Reusing the order id as the saga id makes
    placing the same order twice fail on the saga's primary key instead of charging twice.
    """
    order_id = order_id or str(uuid.uuid4())
    data = OrderData(order_id=order_id, customer_id=customer_id, lines=tuple(lines), amount=amount)
    app.start(session, order_fulfilment, data, saga_id=order_id)
    return order_id


# -- demo data: enough stock and money for N orders, and failures chosen by name -----------------

PRICES = {"SKU-TEA": 450, "SKU-MUG": 1200, "SKU-HONEY": 800, "SKU-SOLD-OUT": 999}
SOLD_OUT_SKU = "SKU-SOLD-OUT"  # seeded with no stock: an order with it fails at inventory
CUSTOMERS = ("alice", "bob", "carol", "dave", "erin")
DECLINED_CUSTOMER = "mallory"  # seeded with a zero balance: her card is always declined
MAX_QUANTITY = 3
FailAt = Literal["inventory", "payment"]


class OrderRequest(TypedDict):
    """Keyword arguments of :func:`place_order`."""

    customer_id: str
    lines: list[inventory.Line]
    amount: int


def sample_order(n: int, fail_at: FailAt | None = None) -> OrderRequest:
    """The ``n``-th demo order, the same every time; ``fail_at`` makes it fail at that service."""
    in_stock = [sku for sku in PRICES if sku != SOLD_OUT_SKU]
    skus = [in_stock[(n + i) % len(in_stock)] for i in range(1 + n % 2)]
    lines = [
        inventory.Line(sku=sku, quantity=1 + (n + i) % MAX_QUANTITY) for i, sku in enumerate(skus)
    ]
    customer = CUSTOMERS[n % len(CUSTOMERS)]
    if fail_at == "inventory":
        lines.append(inventory.Line(sku=SOLD_OUT_SKU, quantity=1))
    elif fail_at == "payment":
        customer = DECLINED_CUSTOMER
    amount = sum(PRICES[line.sku] * line.quantity for line in lines)
    return {"customer_id": customer, "lines": lines, "amount": amount}


def seed(engine: Engine, *, orders: int = 100) -> None:
    """Stock and accounts for ``orders`` sample orders, so only the injected failures fail."""
    units = MAX_QUANTITY * orders  # more than the sample orders can take of any one SKU
    funds = MAX_QUANTITY * sum(PRICES.values()) * orders  # more than any customer can spend
    stock = {sku: 0 if sku == SOLD_OUT_SKU else units for sku in PRICES}
    balances = {**dict.fromkeys(CUSTOMERS, funds), DECLINED_CUSTOMER: 0}
    with engine.begin() as conn:
        conn.execute(
            inventory.stock.insert(),
            [{"sku": k, "total": n, "available": n, "reserved": 0} for k, n in stock.items()],
        )
        conn.execute(
            payment.accounts.insert(),
            [{"customer_id": k, "opening_balance": n, "balance": n} for k, n in balances.items()],
        )


# -- invariants: what must hold whatever failed, checked against the services' own tables --------


def check_invariants(engine: Engine, *, all_terminal: bool = False) -> list[str]:
    """Violations of the order saga's business invariants; an empty list means all hold.

    Call it when the system is quiet (the checks read several tables, not one snapshot). With
    ``all_terminal=True`` (every saga has ended) an order still PENDING is a violation too,
    unless its saga is FAILED (left for an operator).
    """
    with engine.connect() as conn:
        books = Books(conn)
    return [
        *books.stock_violations(),
        *books.money_violations(),
        *books.points_violations(),
        *books.order_violations(all_terminal),
    ]


Lines = dict[str, int]


class Books:
    """Everything the invariants look at, read once."""

    def __init__(self, conn: Connection) -> None:
        self.stock = conn.execute(sa.select(inventory.stock)).all()
        self.reservations: dict[str, str] = dict(
            conn.execute(
                sa.select(inventory.reservations.c.order_id, inventory.reservations.c.status)
            ).all()
        )
        self.reserved_lines = lines_by_order(conn, inventory.reservation_lines)
        self.order_lines = lines_by_order(conn, order_lines)
        self.orders = {row.id: row for row in conn.execute(sa.select(orders))}
        self.charges = {row.order_id: row for row in conn.execute(sa.select(payment.charges))}
        self.accounts = conn.execute(sa.select(payment.accounts)).all()
        self.awards = {row.order_id: row for row in conn.execute(sa.select(loyalty.awards))}
        self.points = dict(
            conn.execute(sa.select(loyalty.points.c.customer_id, loyalty.points.c.points)).all()
        )
        self.sagas = saga_states(conn, order_fulfilment.name, "order_id")

    def stock_violations(self) -> list[str]:
        open_units: dict[str, int] = defaultdict(int)
        for order_id, lines in self.reserved_lines.items():
            if self.reservations.get(order_id) == inventory.ReservationStatus.RESERVED:
                for sku, quantity in lines.items():
                    open_units[sku] += quantity
        out = []
        for sku, total, available, reserved in self.stock:
            if min(total, available, reserved) < 0:
                out.append(f"stock {sku}: negative ({total=}, {available=}, {reserved=})")
            if available + reserved != total:
                out.append(
                    f"stock {sku}: available {available} + reserved {reserved} != total {total}"
                )
            if reserved != open_units[sku]:
                out.append(
                    f"stock {sku}: reserved {reserved} but open reservations hold {open_units[sku]}"
                )
        return out

    def money_violations(self) -> list[str]:
        opening = sum(a.opening_balance for a in self.accounts)
        balances = sum(a.balance for a in self.accounts)
        charged = sum(
            c.amount for c in self.charges.values() if c.status == payment.ChargeStatus.CHARGED
        )
        if balances + charged == opening:
            return []
        return [f"money: balances {balances} + charged {charged} != opening balances {opening}"]

    def points_violations(self) -> list[str]:
        awarded: dict[str, int] = defaultdict(int)
        for award in self.awards.values():
            awarded[award.customer_id] += award.points
        return [
            f"loyalty {customer}: {self.points.get(customer, 0)} points but awards sum to {n}"
            for customer, n in sorted(awarded.items())
            if self.points.get(customer, 0) != n
        ]

    def order_violations(self, all_terminal: bool) -> list[str]:
        out = []
        for order_id, order in sorted(self.orders.items()):
            if order.status == OrderStatus.APPROVED:
                out += [f"order {order_id}: {p}" for p in self.approved_problems(order)]
            elif order.status == OrderStatus.CANCELLED:
                out += [f"order {order_id}: {p}" for p in self.cancelled_problems(order)]
            elif all_terminal and self.sagas.get(order_id) != "FAILED":
                # A FAILED saga waits for an operator; its order is left as it was, on purpose.
                out.append(f"order {order_id}: still {order.status} though every saga has ended")
            out += [f"order {order_id}: {p}" for p in self.saga_problems(order)]
        for order_id in sorted(set(self.charges) - set(self.orders)):
            out.append(f"charge for unknown order {order_id}")
        return out

    def approved_problems(self, order: Any) -> list[str]:
        problems = []
        charge = self.charges.get(order.id)
        if charge is None or charge.status != payment.ChargeStatus.CHARGED:
            problems.append("APPROVED but not charged")
        elif (charge.amount, charge.customer_id) != (order.amount, order.customer_id):
            problems.append(f"charged {charge.amount} to {charge.customer_id}, not {order.amount}")
        if self.reservations.get(order.id) != inventory.ReservationStatus.RESERVED:
            problems.append("APPROVED but its stock is not reserved")
        elif self.reserved_lines.get(order.id) != self.order_lines.get(order.id):
            problems.append("reserved lines differ from the order's lines")
        award = self.awards.get(order.id)
        if award is None or award.points != points_earned(order.amount):
            problems.append("APPROVED but its points were not awarded (or not in full)")
        return problems

    def cancelled_problems(self, order: Any) -> list[str]:
        problems = []
        charge = self.charges.get(order.id)
        if charge is not None and charge.status == payment.ChargeStatus.CHARGED:
            problems.append("CANCELLED but charged")
        if self.reservations.get(order.id) == inventory.ReservationStatus.RESERVED:
            problems.append("CANCELLED but its stock is still reserved")
        if order.id in self.awards:
            problems.append("CANCELLED but points were awarded")
        return problems

    def saga_problems(self, order: Any) -> list[str]:
        expected = {"COMPLETED": OrderStatus.APPROVED, "COMPENSATED": OrderStatus.CANCELLED}
        state = self.sagas.get(order.id)
        if state in expected and order.status != expected[state]:
            return [f"saga {state} but the order is {order.status}"]
        return []


def lines_by_order(conn: Connection, table: sa.Table) -> dict[str, Lines]:
    out: dict[str, Lines] = defaultdict(dict)
    for order_id, sku, quantity in conn.execute(
        sa.select(table.c.order_id, table.c.sku, table.c.quantity)
    ):
        out[order_id][sku] = quantity
    return dict(out)


def saga_states(conn: Connection, saga_type: str, key: str) -> dict[str, str]:
    """The state of each saga of ``saga_type``, by the business key in its data."""
    s = schema.saga_instances
    rows = conn.execute(sa.select(s.c.state, s.c.data).where(s.c.saga_type == saga_type))
    return {json.loads(data)[key]: state for state, data in rows}
