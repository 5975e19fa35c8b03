"""The payer's bank: accounts, and holds that earmark money until a transfer captures or
releases it.

A hold moves through HELD → CAPTURED or HELD → RELEASED, each move a conditional ``UPDATE ... WHERE
status = 'HELD'`` whose row count decides (the business state machine the article recommends for
idempotency): a command delivered twice finds the move already made and changes nothing.
"""

from __future__ import annotations

import enum

import sqlalchemy as sa
from pydantic import Field
from sqlalchemy.orm import Session

from saga_engine import errors
from saga_engine.messages import Message
from saga_engine.participant import Participant
from sagas.services import rowcount

metadata = sa.MetaData()

accounts = sa.Table(
    "ledger_accounts",
    metadata,
    sa.Column("account_id", sa.String(64), primary_key=True),
    sa.Column("opening_balance", sa.BigInteger, nullable=False),
    sa.Column("balance", sa.BigInteger, nullable=False),  # minor units (cents)
    sa.Column("held", sa.BigInteger, nullable=False),  # earmarked by open holds
    sa.CheckConstraint("held >= 0 AND balance >= held", name="ledger_accounts_covered"),
)

holds = sa.Table(
    "ledger_holds",
    metadata,
    sa.Column("transfer_id", sa.String(36), primary_key=True),  # one hold per transfer
    sa.Column("account_id", sa.String(64), nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
)


class HoldStatus(enum.StrEnum):
    HELD = "HELD"
    CAPTURED = "CAPTURED"
    RELEASED = "RELEASED"


class HoldFunds(Message):
    transfer_id: str
    account_id: str
    amount: int = Field(gt=0)


class FundsHeld(Message):
    transfer_id: str


class ReleaseHold(Message):
    transfer_id: str
    account_id: str
    amount: int


class CaptureHold(Message):
    transfer_id: str


service = Participant("ledger", metadata=metadata)


@service.handles(HoldFunds)
def hold_funds(cmd: HoldFunds, tx: Session) -> FundsHeld:
    status = hold_status(tx, cmd.transfer_id)
    if status is HoldStatus.RELEASED:
        raise errors.Rejected("the transfer was cancelled before its funds were held")
    if status is not None:
        return FundsHeld(transfer_id=cmd.transfer_id)  # held before: the same answer again
    earmarked = rowcount(
        tx.execute(
            sa.update(accounts)
            .where(
                accounts.c.account_id == cmd.account_id,
                accounts.c.balance - accounts.c.held >= cmd.amount,
            )
            .values(held=accounts.c.held + cmd.amount)
        )
    )
    if earmarked != 1:
        raise errors.Rejected("insufficient funds")
    insert_hold(tx, cmd.transfer_id, cmd.account_id, cmd.amount, HoldStatus.HELD)
    return FundsHeld(transfer_id=cmd.transfer_id)


@service.handles(ReleaseHold)
def release_hold(cmd: ReleaseHold, tx: Session) -> None:
    """Idempotent: releasing twice, or releasing a hold never made, changes nothing."""
    if hold_status(tx, cmd.transfer_id) is None:
        # Leave a RELEASED marker so a HoldFunds that arrives late is refused. The command
        # carries the account and amount so the marker is complete without asking anyone.
        insert_hold(tx, cmd.transfer_id, cmd.account_id, cmd.amount, HoldStatus.RELEASED)
    elif settle(tx, cmd.transfer_id, HoldStatus.RELEASED):
        tx.execute(
            sa.update(accounts)
            .where(accounts.c.account_id == cmd.account_id)
            .values(held=accounts.c.held - cmd.amount)
        )


@service.handles(CaptureHold)
def capture_hold(cmd: CaptureHold, tx: Session) -> None:
    hold = tx.execute(sa.select(holds).where(holds.c.transfer_id == cmd.transfer_id)).first()
    if hold is None or hold.status == HoldStatus.RELEASED:
        # After the pivot the hold must exist; say so loudly (the saga retries, and shows why).
        raise errors.Rejected(f"no open hold for transfer {cmd.transfer_id}")
    if settle(tx, cmd.transfer_id, HoldStatus.CAPTURED):
        tx.execute(
            sa.update(accounts)
            .where(accounts.c.account_id == hold.account_id)
            .values(balance=accounts.c.balance - hold.amount, held=accounts.c.held - hold.amount)
        )


def hold_status(tx: Session, transfer_id: str) -> HoldStatus | None:
    status = tx.scalar(sa.select(holds.c.status).where(holds.c.transfer_id == transfer_id))
    return None if status is None else HoldStatus(status)


def insert_hold(
    tx: Session, transfer_id: str, account_id: str, amount: int, status: HoldStatus
) -> None:
    row = {"transfer_id": transfer_id, "account_id": account_id, "amount": amount}
    tx.execute(holds.insert(), {**row, "status": status})


def settle(tx: Session, transfer_id: str, status: HoldStatus) -> bool:
    """HELD → ``status``; False if the hold was not HELD (it moved before)."""
    moved = rowcount(
        tx.execute(
            sa.update(holds)
            .where(holds.c.transfer_id == transfer_id, holds.c.status == HoldStatus.HELD)
            .values(status=status)
        )
    )
    return bool(moved == 1)
