"""The order saga in the peer's outline (``sagas/order_outline.py``) on each real database: declined
charges compensate, the others complete, and its invariant check sees a saga that ended wrongly."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from saga_engine import db, schema
from saga_engine.app import App
from saga_engine.testing import ManualClock, Runtime
from sagas import order_outline


def test_declined_orders_compensate_and_the_check_catches_a_wrong_ending(db_url: str) -> None:
    clock = ManualClock()
    app = App(
        "outline",
        sagas=[order_outline.order_outline],
        participants=[order_outline.inventory, order_outline.payment],
        clock=clock,
    )
    engine = db.create_engine(db_url)
    runtime = Runtime(app, engine, clock=clock)
    try:
        app.create_tables(engine)
        ids = []
        for n in range(10):
            with Session(engine) as session, session.begin():
                request = order_outline.sample_order(n, "payment" if n % 5 == 0 else None)
                ids.append(order_outline.place_order(app, session, **request))
        runtime.run_until_quiet()
        s = schema.saga_instances
        with engine.connect() as conn:
            states = dict(conn.execute(sa.select(s.c.id, s.c.state)).all())
        assert [states[i] for i in ids] == [
            "COMPENSATED" if n % 5 == 0 else "COMPLETED" for n in range(10)
        ]
        assert order_outline.check_invariants(engine, all_terminal=True) == []

        with engine.begin() as conn:  # a declined order that ended as if it had been charged
            conn.execute(sa.update(s).where(s.c.id == ids[0]).values(state="COMPLETED"))
        violations = order_outline.check_invariants(engine, all_terminal=True)
        assert violations == [
            f"order {ids[0]}: COMPLETED, expected COMPENSATED",
            f"order {ids[0]}: inventory released 1 times",
        ]
    finally:
        runtime.close()
        engine.dispose()
