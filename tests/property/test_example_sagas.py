"""Every saga in sagas/ under generated fault schedules: the engine's invariants and the
example's own domain invariants hold after every run (500 examples each under the ci profile)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from saga_engine.app import App
from saga_engine.testing import FaultSchedule, fault_schedules, simulate
from sagas import money_transfer, order_fulfilment
from sagas.app import app

pytestmark = [pytest.mark.property, pytest.mark.sqlite]

ORDERS = [
    order_fulfilment.sample_order(1),
    order_fulfilment.sample_order(2),
    order_fulfilment.sample_order(3, fail_at="payment"),
]
TRANSFERS = [
    {"from_account": "acct-alice", "to_account": "acct-shop", "amount": 2500},
    {"from_account": "acct-bob", "to_account": "acct-landlord", "amount": 900, "notify": False},
    {"from_account": "acct-alice", "to_account": money_transfer.CLOSED_PAYEE, "amount": 100},
]


def place(app: App, conn: Connection, order: Any) -> str:
    with Session(bind=conn) as session:
        return order_fulfilment.place_order(app, session, **order)


def transfer(app: App, conn: Connection, request: Any) -> str:
    with Session(bind=conn) as session:
        return money_transfer.start_transfer(app, session, **request)


@given(schedule=fault_schedules(order_fulfilment.order_fulfilment))
def test_order_fulfilment_survives_any_fault_schedule(schedule: FaultSchedule) -> None:
    run = simulate(
        app,
        order_fulfilment.order_fulfilment,
        ORDERS,
        schedule,
        setup=lambda engine: order_fulfilment.seed(engine, orders=10),
        start=place,
    )
    run.assert_invariants(
        domain=lambda engine: order_fulfilment.check_invariants(engine, all_terminal=True)
    )


@given(schedule=fault_schedules(money_transfer.money_transfer))
def test_money_transfer_survives_any_fault_schedule(schedule: FaultSchedule) -> None:
    run = simulate(
        app,
        money_transfer.money_transfer,
        TRANSFERS,
        schedule,
        setup=money_transfer.seed,
        start=transfer,
    )
    run.assert_invariants(
        domain=lambda engine: money_transfer.check_invariants(engine, all_terminal=True)
    )
