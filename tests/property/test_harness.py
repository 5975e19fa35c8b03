"""The fault harness on the engine's own test saga: every generated schedule keeps every
invariant, and a broken compensation is found and shrunk to a short schedule."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, find, given, settings
from sqlalchemy.orm import Session

from saga_engine import errors
from saga_engine.app import App
from saga_engine.definition import Saga, step
from saga_engine.testing import ManualClock
from saga_engine.testing.faults import FaultSchedule, Reject, fault_schedules, simulate
from tests.integration.test_engine import Data, Do, Undo, build_app, effects

pytestmark = [pytest.mark.property, pytest.mark.sqlite]

APP, SAGA = build_app(ManualClock(), {})
ORDERS = [Data(order="o1", express=True), Data(order="o2"), Data(order="o3", reject_at="b")]


@given(schedule=fault_schedules(SAGA))
@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
def test_every_fault_schedule_keeps_the_invariants(schedule: FaultSchedule) -> None:
    simulate(APP, SAGA, ORDERS, schedule).assert_invariants()


# -- a saga whose compensation forgets to undo: the harness must catch it ------------------------

held = sa.Table("held", sa.MetaData(), sa.Column("order", sa.String(32), primary_key=True))


def broken_app() -> tuple[App, Saga[Data]]:
    from saga_engine.participant import Participant

    shop = Participant("shop")

    @shop.handles(Do)
    def hold(cmd: Do, tx: Session) -> None:
        if cmd.reject:
            raise errors.Rejected("no")
        if cmd.step == "hold":
            tx.execute(held.insert().values(order=cmd.order))

    @shop.handles(Undo)
    def release(cmd: Undo, tx: Session) -> None:
        pass  # BUG: the hold is never released

    saga: Saga[Data] = Saga(
        "broken",
        data=Data,
        steps=[
            step("hold")
            .invoke("shop", lambda d: Do(order=d.order, step="hold", reject=False))
            .compensate("shop", lambda d: Undo(order=d.order, step="hold")),
            step("pay").invoke("shop", lambda d: Do(order=d.order, step="pay", reject=False)),
        ],
    )
    return App("broken", sagas=[saga], participants=[shop], metadata=[held.metadata]), saga


def nothing_held_after_compensation(engine: sa.Engine) -> list[str]:
    from saga_engine import schema

    with engine.connect() as conn:
        compensated = set(
            conn.scalars(
                sa.select(schema.saga_instances.c.data).where(
                    schema.saga_instances.c.state == "COMPENSATED"
                )
            )
        )
        holds = set(conn.scalars(sa.select(held.c.order)))
    return [
        f"order {o} still held after compensation"
        for o in holds
        if any(f'"order":"{o}"' in d for d in compensated)
    ]


def test_a_broken_compensation_is_caught_and_shrunk() -> None:
    app, saga = broken_app()

    def violates(schedule: FaultSchedule) -> bool:
        run = simulate(app, saga, [Data(order="o1")], schedule)
        try:
            return bool(run.violations(domain=nothing_held_after_compensation))
        finally:
            run.close()

    smallest = find(
        fault_schedules(saga),
        violates,
        settings=settings(max_examples=300, deadline=None, database=None),
    )
    assert smallest.faults == (Reject(step="pay"),), smallest
    assert effects is not None  # the shared test tables stay importable


def test_replaying_a_schedule_is_deterministic() -> None:
    schedule = FaultSchedule(faults=(Reject(step="b"),), seed=7)
    first = simulate(APP, SAGA, ORDERS, schedule)
    second = simulate(APP, SAGA, ORDERS, schedule)
    try:
        assert sorted(first.states().values()) == sorted(second.states().values())
        assert first.rounds == second.rounds
    finally:
        first.close()
        second.close()
