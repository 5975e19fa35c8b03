"""The notification service: one message to the customer per transfer, never two."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from saga_engine.messages import Message
from saga_engine.participant import Participant

metadata = sa.MetaData()

sent = sa.Table(
    "notifications_sent",
    metadata,
    sa.Column("transfer_id", sa.String(36), primary_key=True),  # the dedupe key
    sa.Column("account_id", sa.String(64), nullable=False),
    sa.Column("text", sa.String(500), nullable=False),
)


class NotifyCustomer(Message):
    transfer_id: str
    account_id: str
    text: str


service = Participant("notifications", metadata=metadata)


@service.handles(NotifyCustomer)
def notify_customer(cmd: NotifyCustomer, tx: Session) -> None:
    if tx.scalar(sa.select(sent.c.transfer_id).where(sent.c.transfer_id == cmd.transfer_id)):
        return  # told before
    # A real service would hand the text to a mail or SMS gateway here, keyed by transfer_id,
    # so a gateway that is asked twice also sends once.
    tx.execute(sent.insert(), cmd.model_dump())
