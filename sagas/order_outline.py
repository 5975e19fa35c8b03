"""The order saga in the outline of the Temporal peer, for a like-for-like comparison.

``saga-engine bench saga --saga outline`` runs it, and ``--peer temporal`` runs the peer in the same
run. The steps are those of the peer's workflow (``saga_engine/bench/temporal_peer.py``): create
the order, reserve the inventory, charge the payment (the pivot), approve the order. A declined
charge (one order in ten) releases the inventory and cancels the order. Like the peer's
activities, the steps do no business work: the participants only answer, and the local steps
write nothing. What is left is the engine's own work for every step, all of it real: the saga's
state in the database, the outbox, the relay, Kafka, the participants' inbox and their replies,
every move one local transaction.

The full example, with stock, money, points and their invariants, is :mod:`sagas.order_fulfilment`;
the bench runs that one unless told otherwise.

    saga-engine worker --app sagas.order_outline:app --db ... --broker kafka://...
"""

from __future__ import annotations

import uuid
from typing import Literal, TypedDict

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from saga_engine import errors, schema
from saga_engine.app import App
from saga_engine.definition import Saga, step
from saga_engine.messages import Message
from saga_engine.participant import Participant


class OutlineOrder(BaseModel):
    order_id: str
    declined: bool = False  # the card is declined: the saga compensates


class ReserveInventory(Message):
    order_id: str


class ReleaseInventory(Message):
    order_id: str


class ChargePayment(Message):
    order_id: str
    declined: bool


inventory = Participant("outline_inventory")
payment = Participant("outline_payment")


@inventory.handles(ReserveInventory)
def reserve(cmd: ReserveInventory, tx: Session) -> None:
    """Answers at once, as the peer's ``reserve_inventory`` activity does."""


@inventory.handles(ReleaseInventory)
def release(cmd: ReleaseInventory, tx: Session) -> None:
    """Answers at once, as the peer's ``release_inventory`` activity does."""


@payment.handles(ChargePayment)
def charge(cmd: ChargePayment, tx: Session) -> None:
    """Declines the orders the peer's ``charge_payment`` declines, and answers the others."""
    if cmd.declined:
        raise errors.Rejected("card declined")


def nothing(data: OutlineOrder, tx: Session) -> None:
    """A local step with no work: the peer's ``create_order``, ``approve_order``, ``cancel_order``."""


order_outline: Saga[OutlineOrder] = Saga(
    "order_outline",
    data=OutlineOrder,
    steps=[
        step("create_order").local(nothing).compensate(nothing),
        (
            step("reserve_inventory")
            .invoke("outline_inventory", lambda d: ReserveInventory(order_id=d.order_id))
            .compensate("outline_inventory", lambda d: ReleaseInventory(order_id=d.order_id))
        ),
        (
            step("charge_payment")
            .invoke(
                "outline_payment",
                lambda d: ChargePayment(order_id=d.order_id, declined=d.declined),
            )
            .pivot()
        ),
        step("approve_order").local(nothing),
    ],
)

app = App("outline", sagas=[order_outline], participants=[inventory, payment])


# -- what the saga benchmark calls (the same functions as sagas.order_fulfilment's) -------------

FailAt = Literal["inventory", "payment"]


class OutlineRequest(TypedDict):
    """Keyword arguments of :func:`place_order`."""

    declined: bool


def place_order(app: App, session: Session, *, declined: bool, order_id: str | None = None) -> str:
    """Start the saga of a new order in the caller's transaction; returns its id."""
    order_id = order_id or str(uuid.uuid4())
    data = OutlineOrder(order_id=order_id, declined=declined)
    return app.start(session, order_outline, data, saga_id=order_id)


def sample_order(n: int, fail_at: FailAt | None = None) -> OutlineRequest:
    """The ``n``-th order; any ``fail_at`` declines its charge (the peer fails only there)."""
    return {"declined": fail_at is not None}


def seed(engine: Engine, *, orders: int = 100) -> None:
    """Nothing to seed: the steps keep no business data."""


def check_invariants(engine: Engine, *, all_terminal: bool = False) -> list[str]:
    """Every declined order compensated, after one release of its inventory; every other order
    completed. An empty list means all hold (with ``all_terminal``, a saga still running fails)."""
    s = schema.saga_instances
    with engine.connect() as conn:
        sagas = conn.execute(
            sa.select(s.c.id, s.c.state, s.c.data).where(s.c.saga_type == order_outline.name)
        ).all()
        releases: dict[str, int] = {}
        # Written to the outbox; delivered ones are in the history where the relays archive.
        for o in (schema.outbox, schema.outbox_history):
            for saga_id, n in conn.execute(
                sa.select(o.c.aggregate_id, sa.func.count())
                .where(o.c.message_type == ReleaseInventory.message_type)
                .group_by(o.c.aggregate_id)
            ).all():
                releases[saga_id] = releases.get(saga_id, 0) + n
    out = []
    for saga_id, state, data in sagas:
        declined = OutlineOrder.model_validate_json(data).declined
        expected = "COMPENSATED" if declined else "COMPLETED"
        if state != expected and (all_terminal or state in ("COMPLETED", "COMPENSATED", "FAILED")):
            out.append(f"order {saga_id}: {state}, expected {expected}")
        if releases.get(saga_id, 0) != (1 if declined and state == "COMPENSATED" else 0):
            out.append(f"order {saga_id}: inventory released {releases.get(saga_id, 0)} times")
    return out
