"""The example sagas of ``sagas/`` run end to end by a real worker, on each database.

Order fulfilment: approved, out of stock, card declined, a mixed batch whose business invariants
must hold, and the handlers' own idempotency. Money transfer: completed and compensated, with the
payee's bank on a second database, and a pivot sent again after its timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, exc
from sqlalchemy.orm import Session

from saga_engine import clock, db, errors, schema
from saga_engine.app import App
from saga_engine.consumer import ConsumerConfig
from saga_engine.demo import failure_plan
from saga_engine.machine import TERMINAL
from saga_engine.outbox.relay import RelayConfig
from saga_engine.participant import Participant
from saga_engine.worker import Worker, WorkerOptions
from sagas import money_transfer, order_fulfilment
from sagas.app import build_app
from sagas.order_fulfilment import OrderStatus, place_order, sample_order
from sagas.services import inventory, ledger, loyalty, notifications, payee_bank, payment

FAST_RELAY = RelayConfig(poll_interval=0.05)
FAST_CONSUMER = ConsumerConfig(poll_timeout=0.1)


# -- helpers ----------------------------------------------------------------------------------------


def fast_app() -> App:
    return build_app(relay=FAST_RELAY, consumer=FAST_CONSUMER)


def open_db(
    url: str, engines: list[Any], app: App, participants: Sequence[str] | None = None
) -> Engine:
    engine = db.create_engine(url)
    engines.append(engine)
    app.create_tables(engine, participants)
    return engine


@contextlib.contextmanager
def running(app: App, url: str, **options: Any) -> Iterator[Worker]:
    worker = Worker(app, WorkerOptions(db_url=url, deadline_interval=0.05, **options))
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


def eventually(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
    return result


def states(engine: Engine, saga_ids: Sequence[str]) -> dict[str, str]:
    s = schema.saga_instances
    with engine.connect() as conn:
        return dict(conn.execute(sa.select(s.c.id, s.c.state).where(s.c.id.in_(saga_ids))).all())


def run_to_end(
    app: App, url: str, engine: Engine, saga_ids: Sequence[str], **options: Any
) -> dict[str, str]:
    """Run a worker until every saga in ``saga_ids`` has ended; returns their states."""

    def ended() -> dict[str, str] | None:
        found = states(engine, saga_ids)
        done = len(found) == len(saga_ids) and set(found.values()) <= TERMINAL
        return found if done else None

    with running(app, url, **options):
        result: dict[str, str] = eventually(ended, f"{len(saga_ids)} sagas to end")
    return result


def place(app: App, engine: Engine, *requests: order_fulfilment.OrderRequest) -> list[str]:
    with Session(engine) as session, session.begin():
        return [place_order(app, session, **request) for request in requests]


def rows(engine: Engine, table: sa.Table, *where: Any) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(table).where(*where)).all())


def last_error(engine: Engine, saga_id: str) -> str:
    s = schema.saga_instances
    with engine.connect() as conn:
        return str(conn.scalar(sa.select(s.c.last_error).where(s.c.id == saga_id)))


def stock_of(engine: Engine, sku: str) -> tuple[int, int, int]:
    (row,) = rows(engine, inventory.stock, inventory.stock.c.sku == sku)
    return row.total, row.available, row.reserved


def order_status(engine: Engine, order_id: str) -> str:
    (row,) = rows(engine, order_fulfilment.orders, order_fulfilment.orders.c.id == order_id)
    return str(row.status)


# -- order fulfilment -------------------------------------------------------------------------------


def test_an_order_is_approved_charged_once_and_awarded_points_once(
    db_url: str, engines: list[Any]
) -> None:
    app = fast_app()
    engine = open_db(db_url, engines, app)
    order_fulfilment.seed(engine, orders=1)
    request = sample_order(0)
    (order_id,) = place(app, engine, request)

    assert run_to_end(app, db_url, engine, [order_id]) == {order_id: "COMPLETED"}
    assert order_status(engine, order_id) == OrderStatus.APPROVED
    (charge,) = rows(engine, payment.charges, payment.charges.c.order_id == order_id)
    assert (charge.amount, charge.status) == (request["amount"], "CHARGED")
    (award,) = rows(engine, loyalty.awards, loyalty.awards.c.order_id == order_id)
    assert award.points == request["amount"] // 100
    for line in request["lines"]:
        total, available, reserved = stock_of(engine, line.sku)
        assert (available, reserved) == (total - line.quantity, line.quantity)
    assert order_fulfilment.check_invariants(engine, all_terminal=True) == []


def test_out_of_stock_cancels_the_order_and_charges_nothing(
    db_url: str, engines: list[Any]
) -> None:
    app = fast_app()
    engine = open_db(db_url, engines, app)
    order_fulfilment.seed(engine, orders=1)
    (order_id,) = place(app, engine, sample_order(0, fail_at="inventory"))

    assert run_to_end(app, db_url, engine, [order_id]) == {order_id: "COMPENSATED"}
    assert order_status(engine, order_id) == OrderStatus.CANCELLED
    assert "out of stock" in last_error(engine, order_id)
    assert rows(engine, payment.charges) == []
    assert rows(engine, inventory.reservations) == []  # rolled back with the rejection
    for sku in order_fulfilment.PRICES:
        total, available, reserved = stock_of(engine, sku)
        assert (available, reserved) == (total, 0)
    assert order_fulfilment.check_invariants(engine, all_terminal=True) == []


def test_a_declined_card_cancels_the_order_and_releases_its_stock(
    db_url: str, engines: list[Any]
) -> None:
    app = fast_app()
    engine = open_db(db_url, engines, app)
    order_fulfilment.seed(engine, orders=1)
    (order_id,) = place(app, engine, sample_order(0, fail_at="payment"))

    assert run_to_end(app, db_url, engine, [order_id]) == {order_id: "COMPENSATED"}
    assert order_status(engine, order_id) == OrderStatus.CANCELLED
    assert "card declined" in last_error(engine, order_id)
    assert rows(engine, payment.charges) == []
    (reservation,) = rows(engine, inventory.reservations)
    assert reservation.status == inventory.ReservationStatus.RELEASED
    for sku in order_fulfilment.PRICES:
        total, available, reserved = stock_of(engine, sku)
        assert (available, reserved) == (total, 0)
    assert order_fulfilment.check_invariants(engine, all_terminal=True) == []


def test_invariants_hold_after_a_mixed_batch(db_url: str, engines: list[Any]) -> None:
    app = fast_app()
    engine = open_db(db_url, engines, app)
    order_fulfilment.seed(engine, orders=50)
    plan = failure_plan(50, 0.3, seed=11)
    order_ids = place(app, engine, *(sample_order(n, fail_at) for n, fail_at in enumerate(plan)))

    ended = run_to_end(app, db_url, engine, order_ids)
    expected = {
        order_id: "COMPENSATED" if fail_at else "COMPLETED"
        for order_id, fail_at in zip(order_ids, plan, strict=True)
    }
    assert ended == expected
    assert order_fulfilment.check_invariants(engine, all_terminal=True) == []


def test_award_points_is_retried_until_it_succeeds(sqlite_url: str, engines: list[Any]) -> None:
    refusals = iter(["loyalty is down", "loyalty is still down"])
    flaky_loyalty = Participant("loyalty", metadata=loyalty.metadata)

    @flaky_loyalty.handles(loyalty.AwardPoints)
    def award_after_two_refusals(cmd: loyalty.AwardPoints, tx: Session) -> None:
        reason = next(refusals, None)
        if reason is not None:
            raise errors.Rejected(reason)
        loyalty.award_points(cmd, tx)

    app = App(
        "shop",
        sagas=[order_fulfilment.order_fulfilment],
        participants=[inventory.service, payment.service, flaky_loyalty],
        metadata=[order_fulfilment.metadata],
        relay=FAST_RELAY,
        consumer=FAST_CONSUMER,
    )
    engine = open_db(sqlite_url, engines, app)
    order_fulfilment.seed(engine, orders=1)
    (order_id,) = place(app, engine, sample_order(0))

    assert run_to_end(app, sqlite_url, engine, [order_id]) == {order_id: "COMPLETED"}
    assert next(refusals, None) is None  # both refusals were used up
    assert len(rows(engine, loyalty.awards)) == 1
    assert order_fulfilment.check_invariants(engine, all_terminal=True) == []


def test_stock_handlers_are_idempotent(db_url: str, engines: list[Any]) -> None:
    app = fast_app()
    engine = open_db(db_url, engines, app)
    order_fulfilment.seed(engine, orders=1)
    lines = (inventory.Line(sku="SKU-TEA", quantity=2),)
    reserve = inventory.ReserveStock(order_id="o-1", lines=lines)
    with Session(engine) as tx, tx.begin():
        inventory.reserve_stock(reserve, tx)
        inventory.reserve_stock(reserve, tx)  # delivered twice: reserved once
    assert stock_of(engine, "SKU-TEA")[1:] == (3 - 2, 2)
    with Session(engine) as tx, tx.begin():
        inventory.release_stock(inventory.ReleaseStock(order_id="o-1"), tx)
        inventory.release_stock(inventory.ReleaseStock(order_id="o-1"), tx)  # released once
    assert stock_of(engine, "SKU-TEA")[1:] == (3, 0)

    # A release that overtakes its reservation leaves a marker: the late reservation is refused.
    with Session(engine) as tx, tx.begin():
        inventory.release_stock(inventory.ReleaseStock(order_id="o-2"), tx)
        with pytest.raises(errors.Rejected):
            inventory.reserve_stock(inventory.ReserveStock(order_id="o-2", lines=lines), tx)
    assert stock_of(engine, "SKU-TEA")[1:] == (3, 0)


def test_a_charge_is_made_once_per_order(db_url: str, engines: list[Any]) -> None:
    app = fast_app()
    engine = open_db(db_url, engines, app)
    order_fulfilment.seed(engine, orders=1)
    charge = payment.ChargePayment(order_id="o-1", customer_id="alice", amount=500)
    with Session(engine) as tx, tx.begin():
        first = payment.charge_payment(charge, tx)
        again = payment.charge_payment(charge, tx)
    assert first == again
    (account,) = rows(engine, payment.accounts, payment.accounts.c.customer_id == "alice")
    assert account.opening_balance - account.balance == 500


def test_placing_the_same_order_twice_is_refused(sqlite_url: str, engines: list[Any]) -> None:
    app = fast_app()
    engine = open_db(sqlite_url, engines, app)
    with Session(engine) as session, session.begin():
        place_order(app, session, **sample_order(0), order_id="o-1")
    with pytest.raises(exc.IntegrityError), Session(engine) as session, session.begin():
        place_order(app, session, **sample_order(0), order_id="o-1")
    assert len(rows(engine, order_fulfilment.orders)) == 1
    assert len(rows(engine, schema.saga_instances)) == 1


# -- money transfer ---------------------------------------------------------------------------------


def start_transfers(app: App, engine: Engine, *transfers: dict[str, Any]) -> list[str]:
    with Session(engine) as session, session.begin():
        return [money_transfer.start_transfer(app, session, **t) for t in transfers]


TRANSFERS = [
    {"from_account": "acct-alice", "to_account": "acct-shop", "amount": 2_500},
    {"from_account": "acct-bob", "to_account": "acct-landlord", "amount": 40_000, "notify": False},
    {"from_account": "acct-alice", "to_account": money_transfer.CLOSED_PAYEE, "amount": 1_000},
    {"from_account": "acct-bob", "to_account": "acct-shop", "amount": 10**9},  # too much
]
OUTCOMES = ["COMPLETED", "COMPLETED", "COMPENSATED", "COMPENSATED"]


def test_transfers_complete_and_compensate(db_url: str, engines: list[Any]) -> None:
    app = fast_app()
    engine = open_db(db_url, engines, app)
    money_transfer.seed(engine)
    ids = start_transfers(app, engine, *TRANSFERS)

    assert run_to_end(app, db_url, engine, ids) == dict(zip(ids, OUTCOMES, strict=True))
    holds = {h.transfer_id: h.status for h in rows(engine, ledger.holds)}
    assert holds == {ids[0]: "CAPTURED", ids[1]: "CAPTURED", ids[2]: "RELEASED"}
    assert "insufficient funds" in last_error(engine, ids[3])
    assert [n.transfer_id for n in rows(engine, notifications.sent)] == [ids[0]]  # .when(notify)
    assert money_transfer.check_invariants(engine, all_terminal=True) == []


def test_the_payee_bank_runs_on_a_second_database(
    db_url: str, sqlite_url: str, engines: list[Any]
) -> None:
    app = fast_app()
    others = [name for name in app.participants if name != "payee_bank"]
    engine = open_db(db_url, engines, app, participants=others)
    payee_engine = open_db(sqlite_url, engines, app, participants=["payee_bank"])
    money_transfer.seed(engine, payee_engine)
    ids = start_transfers(app, engine, *TRANSFERS)

    ended = run_to_end(app, db_url, engine, ids, participant_dbs={"payee_bank": sqlite_url})
    assert ended == dict(zip(ids, OUTCOMES, strict=True))
    assert sa.inspect(engine).has_table(payee_bank.credits.name) is False
    assert len(rows(payee_engine, payee_bank.credits)) == 2  # and its inbox saw the commands:
    with payee_engine.connect() as conn:
        seen = conn.scalar(sa.select(sa.func.count()).select_from(schema.inbox))
    assert seen == 3  # the two completed transfers and the closed account's refusal
    checks = money_transfer.check_invariants(engine, payee_engine=payee_engine, all_terminal=True)
    assert checks == []


class MovableClock:
    """The wall clock plus an offset the test moves forward (to pass a timeout at once)."""

    def __init__(self) -> None:
        self.offset = timedelta(0)

    def now(self) -> datetime:
        return clock.SYSTEM.now() + self.offset


def test_the_pivot_is_sent_again_after_its_timeout_and_applied_once(
    sqlite_url: str, engines: list[Any]
) -> None:
    moved = MovableClock()
    app = App(
        "transfers",
        sagas=[money_transfer.money_transfer],
        participants=[ledger.service, payee_bank.service, notifications.service],
        relay=FAST_RELAY,
        consumer=FAST_CONSUMER,
        clock=moved,
    )
    engine = open_db(sqlite_url, engines, app)
    money_transfer.seed(engine)
    (transfer_id,) = start_transfers(app, engine, TRANSFERS[0])
    q = schema.transport_messages

    def waiting_for_payee(n: int) -> Callable[[], bool]:
        def check() -> bool:
            where = q.c.channel == payee_bank.service.channel
            with engine.connect() as conn:
                return conn.scalar(sa.select(sa.func.count()).select_from(q).where(where)) == n

        return check

    # The payee's bank is down: CreditPayee waits in the transport, then its timeout passes.
    with running(app, sqlite_url, participants=["ledger", "notifications"]):
        eventually(waiting_for_payee(1), "the first CreditPayee")
        moved.offset = timedelta(seconds=money_transfer.PAYEE_TIMEOUT_SECONDS + 1)
        eventually(waiting_for_payee(2), "CreditPayee sent again after the timeout")

    # The bank comes back and gets both copies: it applies the command once.
    assert run_to_end(app, sqlite_url, engine, [transfer_id]) == {transfer_id: "COMPLETED"}
    assert len(rows(engine, payee_bank.credits)) == 1
    duplicates = schema.inbox_duplicates
    assert [d.consumer for d in rows(engine, duplicates)] == ["participant:payee_bank"]
    assert money_transfer.check_invariants(engine, all_terminal=True) == []


# -- the invariant checkers themselves ----------------------------------------------------------------


def test_the_order_invariants_see_broken_books(sqlite_url: str, engines: list[Any]) -> None:
    app = fast_app()
    engine = open_db(sqlite_url, engines, app)
    order_fulfilment.seed(engine, orders=1)
    with engine.begin() as conn:
        order = {"id": "o-1", "customer_id": "alice", "amount": 900}
        conn.execute(order_fulfilment.orders.insert(), {**order, "status": "APPROVED"})
        conn.execute(
            sa.update(inventory.stock).where(inventory.stock.c.sku == "SKU-TEA").values(reserved=1)
        )
        conn.execute(
            sa.update(payment.accounts)
            .where(payment.accounts.c.customer_id == "bob")
            .values(balance=payment.accounts.c.balance - 1)
        )
        conn.execute(order_fulfilment.orders.insert(), {**order, "id": "o-2", "status": "PENDING"})

    violations = order_fulfilment.check_invariants(engine, all_terminal=True)
    assert any(v.startswith("stock SKU-TEA: available") for v in violations)
    assert any(v.startswith("stock SKU-TEA: reserved 1 but open") for v in violations)
    assert any(v.startswith("money:") for v in violations)
    assert "order o-1: APPROVED but not charged" in violations
    assert "order o-1: APPROVED but its stock is not reserved" in violations
    assert "order o-2: still PENDING though every saga has ended" in violations
    assert not any("o-2" in v for v in order_fulfilment.check_invariants(engine))


def test_the_transfer_invariants_see_broken_books(sqlite_url: str, engines: list[Any]) -> None:
    app = fast_app()
    engine = open_db(sqlite_url, engines, app)
    money_transfer.seed(engine)
    with engine.begin() as conn:
        conn.execute(
            payee_bank.credits.insert(),
            {"transfer_id": "t-1", "account_id": "acct-shop", "amount": 5},
        )
    violations = money_transfer.check_invariants(engine)
    assert violations == [
        "payee acct-shop: balance 0 is not opening + credits",
        "money: 200000 in both banks, 200000 at opening, 5 in flight",
    ]
    with engine.begin() as conn:
        conn.execute(
            sa.update(payee_bank.accounts)
            .values(balance=5)
            .where(payee_bank.accounts.c.account_id == "acct-shop")
        )
    assert money_transfer.check_invariants(engine) == []  # in flight: credited, not yet captured
    assert money_transfer.check_invariants(engine, all_terminal=True) == [
        "money: 200005 in both banks, 200000 at opening, 5 in flight"
    ]
