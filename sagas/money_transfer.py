"""Money transfer between two banks: a second saga, to show the DSL is not about orders.

    hold_funds        ledger: HoldFunds              undo: ReleaseHold
    credit_payee      payee_bank: CreditPayee  (the pivot; no reply in time → send it again)
    capture_hold      ledger: CaptureHold      (retried until it succeeds)
    notify_customer   notifications: NotifyCustomer, only if the customer asked (``.when``)

Unlike the order saga it has no local steps: the orchestrator only keeps the saga instances, and
each bank may run on its own database (``WorkerOptions(participant_dbs={"payee_bank": url})``).
Money is earmarked first and taken last, so a payee that refuses costs the payer nothing.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel, Field
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from saga_engine import schema
from saga_engine.app import App
from saga_engine.definition import Saga, step
from sagas.services import ledger, notifications, payee_bank

PAYEE_TIMEOUT_SECONDS = 10.0  # no reply from the other bank by then: ask again (it deduplicates)


class TransferData(BaseModel):
    transfer_id: str
    from_account: str
    to_account: str
    amount: int = Field(gt=0)  # minor units (cents)
    notify: bool = True


def hold_for(d: TransferData) -> ledger.HoldFunds:
    return ledger.HoldFunds(transfer_id=d.transfer_id, account_id=d.from_account, amount=d.amount)


def release_for(d: TransferData) -> ledger.ReleaseHold:
    return ledger.ReleaseHold(transfer_id=d.transfer_id, account_id=d.from_account, amount=d.amount)


def credit_for(d: TransferData) -> payee_bank.CreditPayee:
    return payee_bank.CreditPayee(
        transfer_id=d.transfer_id, account_id=d.to_account, amount=d.amount
    )


def capture_for(d: TransferData) -> ledger.CaptureHold:
    return ledger.CaptureHold(transfer_id=d.transfer_id)


def notice_for(d: TransferData) -> notifications.NotifyCustomer:
    text = f"You sent {d.amount / 100:.2f} to {d.to_account}."
    return notifications.NotifyCustomer(
        transfer_id=d.transfer_id, account_id=d.from_account, text=text
    )


money_transfer = Saga(
    "money_transfer",
    data=TransferData,
    steps=[
        step("hold_funds").invoke("ledger", hold_for).compensate("ledger", release_for),
        (
            step("credit_payee")
            .invoke("payee_bank", credit_for)
            .timeout(PAYEE_TIMEOUT_SECONDS, on_timeout="retry")
            .pivot()
        ),
        step("capture_hold").invoke("ledger", capture_for).retriable(),
        (
            step("notify_customer")
            .invoke("notifications", notice_for)
            .when(lambda d: d.notify)
            .retriable()
        ),
    ],
)


def start_transfer(
    app: App,
    session: Session,
    *,
    from_account: str,
    to_account: str,
    amount: int,
    notify: bool = True,
    transfer_id: str | None = None,
) -> str:
    """Start a transfer in the caller's transaction; returns its id (also the saga's id)."""
    transfer_id = transfer_id or str(uuid.uuid4())
    data = TransferData(
        transfer_id=transfer_id,
        from_account=from_account,
        to_account=to_account,
        amount=amount,
        notify=notify,
    )
    app.start(session, money_transfer, data, saga_id=transfer_id)
    return transfer_id


# -- demo data ------------------------------------------------------------------------------------

PAYERS = ("acct-alice", "acct-bob")
PAYEES = ("acct-shop", "acct-landlord")
CLOSED_PAYEE = "acct-closed"  # exists at the payee's bank but refuses credits: fails the pivot


def seed(engine: Engine, payee_engine: Engine | None = None, *, funds: int = 100_000) -> None:
    """Payer accounts with ``funds`` each in the ledger; payee accounts at the payee's bank."""
    with engine.begin() as conn:
        conn.execute(
            ledger.accounts.insert(),
            [
                {"account_id": a, "opening_balance": funds, "balance": funds, "held": 0}
                for a in PAYERS
            ],
        )
    with (payee_engine or engine).begin() as conn:
        conn.execute(
            payee_bank.accounts.insert(),
            [
                {"account_id": a, "opening_balance": 0, "balance": 0, "open": a != CLOSED_PAYEE}
                for a in (*PAYEES, CLOSED_PAYEE)
            ],
        )


# -- invariants across both banks -----------------------------------------------------------------


def check_invariants(
    engine: Engine, *, payee_engine: Engine | None = None, all_terminal: bool = False
) -> list[str]:
    """Violations of the transfer invariants (empty: all hold). ``engine`` holds the saga
    instances, the ledger and the notifications; ``payee_engine`` the payee's bank, if apart."""
    with engine.connect() as conn:
        payers = conn.execute(sa.select(ledger.accounts)).all()
        holds = {row.transfer_id: row for row in conn.execute(sa.select(ledger.holds))}
        notices = set(conn.scalars(sa.select(notifications.sent.c.transfer_id)))
        s = schema.saga_instances
        transfers = conn.execute(
            sa.select(s.c.state, s.c.data).where(s.c.saga_type == money_transfer.name)
        ).all()
    with (payee_engine or engine).connect() as conn:
        payees = conn.execute(sa.select(payee_bank.accounts)).all()
        credits = {row.transfer_id: row for row in conn.execute(sa.select(payee_bank.credits))}
    out = [
        *ledger_problems(payers, holds),
        *payee_problems(payees, credits),
        *conservation_problems(payers, payees, holds, credits, all_terminal),
    ]
    for state, data in transfers:
        transfer = TransferData.model_validate(json.loads(data))
        for problem in transfer_problems(transfer, state, holds, credits, notices):
            out.append(f"transfer {transfer.transfer_id}: {problem}")
    return out


def ledger_problems(payers: Sequence[Any], holds: dict[str, Any]) -> list[str]:
    held: dict[str, int] = defaultdict(int)
    captured: dict[str, int] = defaultdict(int)
    for hold in holds.values():
        if hold.status == ledger.HoldStatus.HELD:
            held[hold.account_id] += hold.amount
        elif hold.status == ledger.HoldStatus.CAPTURED:
            captured[hold.account_id] += hold.amount
    out = []
    for a in payers:
        if a.held != held[a.account_id] or not 0 <= a.held <= a.balance:
            out.append(f"ledger {a.account_id}: held {a.held}, open holds {held[a.account_id]}")
        if a.balance != a.opening_balance - captured[a.account_id]:
            out.append(f"ledger {a.account_id}: balance {a.balance} is not opening - captured")
    return out


def payee_problems(payees: Sequence[Any], credits: dict[str, Any]) -> list[str]:
    credited: dict[str, int] = defaultdict(int)
    for credit in credits.values():
        credited[credit.account_id] += credit.amount
    return [
        f"payee {a.account_id}: balance {a.balance} is not opening + credits"
        for a in payees
        if a.balance != a.opening_balance + credited[a.account_id]
    ]


def conservation_problems(
    payers: Sequence[Any],
    payees: Sequence[Any],
    holds: dict[str, Any],
    credits: dict[str, Any],
    all_terminal: bool,
) -> list[str]:
    """Across both banks, money is neither made nor lost: while a transfer is between its credit
    and its capture the payee has it already and the payer still; once all ended, never."""
    opening = sum(a.opening_balance for a in (*payers, *payees))
    now = sum(a.balance for a in (*payers, *payees))
    captured = sum(h.amount for h in holds.values() if h.status == ledger.HoldStatus.CAPTURED)
    in_flight = sum(c.amount for c in credits.values()) - captured
    if now != opening + in_flight or in_flight < 0 or (all_terminal and in_flight):
        return [f"money: {now} in both banks, {opening} at opening, {in_flight} in flight"]
    return []


def transfer_problems(
    t: TransferData, state: str, holds: dict[str, Any], credits: dict[str, Any], notices: set[str]
) -> list[str]:
    hold, credit = holds.get(t.transfer_id), credits.get(t.transfer_id)
    hold_status = hold.status if hold is not None else None
    if state == "COMPLETED":
        problems = []
        if hold is None or hold_status != ledger.HoldStatus.CAPTURED or hold.amount != t.amount:
            problems.append(f"COMPLETED but the payer's hold is {hold_status}")
        if credit is None or (credit.account_id, credit.amount) != (t.to_account, t.amount):
            problems.append("COMPLETED but the payee was not credited its amount")
        if (t.transfer_id in notices) != t.notify:
            problems.append(f"notified {t.transfer_id in notices}, asked for {t.notify}")
        return problems
    if state == "COMPENSATED":
        problems = []
        if hold_status in (ledger.HoldStatus.HELD, ledger.HoldStatus.CAPTURED):
            problems.append(f"COMPENSATED but the payer's hold is {hold_status}")
        if credit is not None:
            problems.append("COMPENSATED but the payee was credited")
        return problems
    return []
