"""Invalid saga definitions are rejected when the module is loaded, naming saga and step."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from saga_engine import errors, schema
from saga_engine.app import App
from saga_engine.definition import MAX_SAGA_NAME, MAX_STEP_NAME, Saga, StepKind, step
from saga_engine.machine import SagaMachine
from saga_engine.messages import Message
from saga_engine.participant import MAX_PARTICIPANT_NAME, Participant


class D(BaseModel):
    n: int = 0


class Cmd(Message):
    n: int = 0


def cmd(_: Any) -> Cmd:
    return Cmd()


def undo(_: Any) -> Cmd:
    return Cmd(n=-1)


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        (
            [step("a").invoke("p", cmd).compensate("p", undo), step("a").invoke("p", cmd)],
            "saga 'bad', step 'a': duplicate step name",
        ),
        (
            [step("a").invoke("p", cmd), step("b").invoke("p", cmd)],
            "saga 'bad', step 'a': a compensatable step before the pivot needs .compensate(...)",
        ),
        (
            [step("a").invoke("p", cmd).pivot(), step("b").invoke("p", cmd).compensate("p", undo)],
            "saga 'bad', step 'b': a step after the pivot cannot be compensated",
        ),
        (
            [step("a").invoke("p", cmd).retriable(), step("b").invoke("p", cmd).pivot()],
            "saga 'bad', step 'a': a retriable step must come after the pivot",
        ),
        (
            [step("a").invoke("p", cmd).pivot(), step("b").invoke("p", cmd).pivot()],
            "saga 'bad', step 'b': more than one pivot",
        ),
        ([step("a")], "saga 'bad', step 'a': no action"),
        (
            [step("a").local(lambda d, s: None).on_reply(lambda d, r: d)],
            "saga 'bad', step 'a': on_reply needs an .invoke(...) step",
        ),
        (
            [step("a").invoke("p", cmd).timeout(5, "fail")],
            "saga 'bad', step 'a': on_timeout='fail' needs a compensatable step",
        ),
        ([], "saga 'bad': a saga needs at least one step"),
    ],
)
def test_invalid_definitions_are_rejected_with_saga_and_step(
    steps: list[Any], message: str
) -> None:
    with pytest.raises(errors.DefinitionError) as raised:
        Saga("bad", data=D, steps=steps)
    assert str(raised.value).startswith(message)


def test_data_must_be_a_pydantic_model() -> None:
    with pytest.raises(errors.DefinitionError, match="data must be a pydantic model class"):
        Saga("bad", data=dict, steps=[step("a").local(lambda d, s: None)])  # type: ignore[type-var]


def test_unknown_participant_is_rejected_when_the_app_is_built() -> None:
    saga = Saga("s", data=D, steps=[step("a").invoke("ghost", cmd)])
    with pytest.raises(
        errors.DefinitionError, match="saga 's', step 'a': unknown participant 'ghost'"
    ):
        App("x", sagas=[saga], participants=[Participant("real")])


def test_without_a_pivot_the_last_step_is_the_pivot() -> None:
    saga = Saga(
        "s",
        data=D,
        steps=[step("a").invoke("p", cmd).compensate("p", undo), step("b").invoke("p", cmd)],
    )
    assert [s.kind for s in saga.steps] == [StepKind.COMPENSATABLE, StepKind.PIVOT]


def test_kinds_are_inferred_around_the_pivot() -> None:
    saga = Saga(
        "s",
        data=D,
        steps=[
            step("a").invoke("p", cmd).compensate("p", undo),
            step("b").invoke("p", cmd).pivot(),
            step("c").local(lambda d, s: None),  # after the pivot: retriable without saying so
        ],
    )
    assert [s.kind for s in saga.steps] == [
        StepKind.COMPENSATABLE,
        StepKind.PIVOT,
        StepKind.RETRIABLE,
    ]


def test_the_machine_refuses_moves_the_definition_does_not_allow() -> None:
    saga = Saga(
        "s",
        data=D,
        steps=[
            step("a").invoke("p", cmd).compensate("p", undo),
            step("b").invoke("p", cmd).when(lambda d: d.n > 0).compensate("p", undo),
            step("c").invoke("p", cmd),
        ],
    )
    machine = SagaMachine(saga)
    assert machine.fire("a", "proceed", "c") == "c"  # b may be skipped: allowed
    assert machine.fire("c", "fail", "compensate_a") == "compensate_a"  # b was skipped
    with pytest.raises(errors.InvalidTransition):
        machine.fire("a", "proceed", "COMPLETED")  # c cannot be skipped
    with pytest.raises(errors.InvalidTransition):
        machine.fire("COMPLETED", "fail", "compensate_a")
    # Asked again (the machine remembers the moves it allowed), the answers are the same.
    for _ in range(2):
        assert machine.fire("a", "proceed", "c") == "c"
        assert machine.fire("a", "proceed", "b") == "b"
        with pytest.raises(errors.InvalidTransition):
            machine.fire("a", "proceed", "COMPLETED")
        with pytest.raises(errors.InvalidTransition):
            machine.fire("b", "proceed", "b")


def test_an_explicit_pivot_cannot_have_a_compensation() -> None:
    with pytest.raises(errors.DefinitionError, match="step 'b': the pivot cannot be compensated"):
        Saga(
            "bad",
            data=D,
            steps=[
                step("a").invoke("p", cmd).compensate("p", undo),
                step("b").invoke("p", cmd).compensate("p", undo).pivot(),
            ],
        )


def test_an_unknown_on_timeout_is_a_definition_error() -> None:
    with pytest.raises(errors.DefinitionError, match="on_timeout must be 'retry' or 'fail'"):
        step("a").invoke("p", cmd).timeout(5, "explode")


def test_names_longer_than_the_tables_can_hold_are_refused_when_defined() -> None:
    local = step("a").local(lambda d, s: None)
    with pytest.raises(errors.DefinitionError, match=r"saga 'ss*': the name has 65 characters"):
        Saga("s" * (MAX_SAGA_NAME + 1), data=D, steps=[local])
    with pytest.raises(errors.DefinitionError, match="a step name needs 1 to 128 characters"):
        Saga("ok", data=D, steps=[step("t" * (MAX_STEP_NAME + 1)).local(lambda d, s: None)])
    with pytest.raises(errors.DefinitionError, match="117 characters, more than 116"):
        Participant("p" * (MAX_PARTICIPANT_NAME + 1))
    Saga("s" * MAX_SAGA_NAME, data=D, steps=[step("t" * MAX_STEP_NAME).local(lambda d, s: None)])
    Participant("p" * MAX_PARTICIPANT_NAME)


def test_the_name_limits_are_what_the_columns_hold() -> None:
    """Each limit comes from a column: change the schema, and this says which limit to change."""
    assert schema.outbox.c.aggregate_type.type.length == MAX_SAGA_NAME
    assert schema.saga_instances.c.saga_type.type.length >= MAX_SAGA_NAME
    compensating = len("compensate_") + MAX_STEP_NAME
    assert compensating <= schema.saga_instances.c.state.type.length
    consumer = len("participant:") + MAX_PARTICIPANT_NAME
    assert consumer == schema.inbox.c.consumer.type.length
    assert consumer <= schema.dead_letters.c.consumer.type.length
