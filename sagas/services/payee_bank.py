"""The payee's bank: another bank, often on another database (``participant_dbs``).

Crediting is the transfer's pivot. A credit is keyed by transfer, so the saga may safely send
``CreditPayee`` again when no reply comes in time: a second delivery finds the credit and answers
the same way.
"""

from __future__ import annotations

import sqlalchemy as sa
from pydantic import Field
from sqlalchemy.orm import Session

from saga_engine import errors
from saga_engine.messages import Message
from saga_engine.participant import Participant
from sagas.services import rowcount

metadata = sa.MetaData()

accounts = sa.Table(
    "payee_accounts",
    metadata,
    sa.Column("account_id", sa.String(64), primary_key=True),
    sa.Column("opening_balance", sa.BigInteger, nullable=False),
    sa.Column("balance", sa.BigInteger, nullable=False),
    sa.Column("open", sa.Boolean, nullable=False),
)

credits = sa.Table(
    "payee_credits",
    metadata,
    sa.Column("transfer_id", sa.String(36), primary_key=True),  # one credit per transfer
    sa.Column("account_id", sa.String(64), nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),
)


class CreditPayee(Message):
    transfer_id: str
    account_id: str
    amount: int = Field(gt=0)


class PayeeCredited(Message):
    transfer_id: str


service = Participant("payee_bank", metadata=metadata)


@service.handles(CreditPayee)
def credit_payee(cmd: CreditPayee, tx: Session) -> PayeeCredited:
    done = tx.scalar(
        sa.select(credits.c.transfer_id).where(credits.c.transfer_id == cmd.transfer_id)
    )
    if done is not None:
        return PayeeCredited(transfer_id=cmd.transfer_id)  # credited before
    credited = rowcount(
        tx.execute(
            sa.update(accounts)
            .where(accounts.c.account_id == cmd.account_id, accounts.c.open.is_(True))
            .values(balance=accounts.c.balance + cmd.amount)
        )
    )
    if credited != 1:
        raise errors.Rejected(f"no open account {cmd.account_id} at the payee's bank")
    credit = {"transfer_id": cmd.transfer_id, "account_id": cmd.account_id, "amount": cmd.amount}
    tx.execute(credits.insert(), credit)
    return PayeeCredited(transfer_id=cmd.transfer_id)
