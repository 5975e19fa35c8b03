"""The payment service: customer accounts and the charges made on them.

A charge is unique per order, so a redelivered ``ChargePayment`` finds its charge and answers with
the same charge id instead of charging twice. Amounts are integers in minor units (cents): sums
stay exact on every database.
"""

from __future__ import annotations

import enum
import uuid

import sqlalchemy as sa
from pydantic import Field
from sqlalchemy.orm import Session

from saga_engine import errors
from saga_engine.messages import Message
from saga_engine.participant import Participant
from sagas.services import rowcount

metadata = sa.MetaData()

accounts = sa.Table(
    "payment_accounts",
    metadata,
    sa.Column("customer_id", sa.String(64), primary_key=True),
    sa.Column("opening_balance", sa.BigInteger, nullable=False),
    sa.Column("balance", sa.BigInteger, nullable=False),
    sa.CheckConstraint("balance >= 0", name="payment_accounts_not_overdrawn"),
)

charges = sa.Table(
    "payment_charges",
    metadata,
    sa.Column("charge_id", sa.String(36), primary_key=True),
    sa.Column("order_id", sa.String(36), nullable=False, unique=True),  # one charge per order
    sa.Column("customer_id", sa.String(64), nullable=False),
    sa.Column("amount", sa.BigInteger, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
)


class ChargeStatus(enum.StrEnum):
    CHARGED = "CHARGED"
    # The order saga never refunds (its charge is the pivot); customer service does, later.
    REFUNDED = "REFUNDED"


class ChargePayment(Message):
    order_id: str
    customer_id: str
    amount: int = Field(gt=0)


class PaymentCharged(Message):
    order_id: str
    charge_id: str


service = Participant("payment", metadata=metadata)


@service.handles(ChargePayment)
def charge_payment(cmd: ChargePayment, tx: Session) -> PaymentCharged:
    existing = tx.scalar(sa.select(charges.c.charge_id).where(charges.c.order_id == cmd.order_id))
    if existing is not None:
        return PaymentCharged(order_id=cmd.order_id, charge_id=existing)  # charged before
    debited = rowcount(
        tx.execute(
            sa.update(accounts)
            .where(accounts.c.customer_id == cmd.customer_id, accounts.c.balance >= cmd.amount)
            .values(balance=accounts.c.balance - cmd.amount)
        )
    )
    if debited != 1:
        raise errors.Rejected("card declined")
    charge_id = str(uuid.uuid4())
    # A concurrent duplicate fails here on the unique order_id and rolls back its debit too.
    tx.execute(
        charges.insert(),
        {
            "charge_id": charge_id,
            "order_id": cmd.order_id,
            "customer_id": cmd.customer_id,
            "amount": cmd.amount,
            "status": ChargeStatus.CHARGED,
        },
    )
    return PaymentCharged(order_id=cmd.order_id, charge_id=charge_id)
