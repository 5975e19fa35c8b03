"""The loyalty service: points per customer, awarded once per order.

The award row, keyed by order, is what makes ``AwardPoints`` idempotent: the points are added in
the same transaction that inserts it, so a second delivery finds it and adds nothing.
"""

from __future__ import annotations

import sqlalchemy as sa
from pydantic import Field
from sqlalchemy.orm import Session

from saga_engine.messages import Message
from saga_engine.participant import Participant
from sagas.services import rowcount

metadata = sa.MetaData()

points = sa.Table(
    "loyalty_points",
    metadata,
    sa.Column("customer_id", sa.String(64), primary_key=True),
    sa.Column("points", sa.BigInteger, nullable=False),
)

awards = sa.Table(
    "loyalty_awards",
    metadata,
    sa.Column("order_id", sa.String(36), primary_key=True),  # at most one award per order
    sa.Column("customer_id", sa.String(64), nullable=False),
    sa.Column("points", sa.BigInteger, nullable=False),
)


class AwardPoints(Message):
    order_id: str
    customer_id: str
    points: int = Field(ge=0)


service = Participant("loyalty", metadata=metadata)


@service.handles(AwardPoints)
def award_points(cmd: AwardPoints, tx: Session) -> None:
    if tx.scalar(sa.select(awards.c.order_id).where(awards.c.order_id == cmd.order_id)):
        return  # awarded before
    award = {"order_id": cmd.order_id, "customer_id": cmd.customer_id, "points": cmd.points}
    tx.execute(awards.insert(), award)
    added = rowcount(
        tx.execute(
            sa.update(points)
            .where(points.c.customer_id == cmd.customer_id)
            .values(points=points.c.points + cmd.points)
        )
    )
    if added == 0:  # the customer's first points
        tx.execute(points.insert(), {"customer_id": cmd.customer_id, "points": cmd.points})
