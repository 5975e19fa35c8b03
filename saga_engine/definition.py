"""The saga DSL: what a team writes in an ordinary Python module.

    order_fulfilment = Saga("order_fulfilment", data=OrderData, steps=[
        step("reserve_inventory")
            .invoke("inventory", reserve_for, reply=StockReserved)
            .compensate("inventory", release_for),
        step("charge_payment").invoke("payment", charge_for).on_reply(remember_payment).pivot(),
        step("award_points").invoke("loyalty", points_for).retriable(),
        step("approve_order").local(approve_order),
    ])

Step kinds follow the saga literature: *compensatable* steps come first and each has a
compensation; at most one *pivot* is the point of no return (when none is marked, the last step is
the pivot); *retriable* steps come after the pivot, have no compensation and are retried until they
succeed (steps after the pivot are retriable whether marked or not). ``Saga(...)`` checks all of this when the module is imported and raises
:class:`errors.DefinitionError` naming the saga and the step.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from pydantic import BaseModel
from sqlalchemy.orm import Session

from saga_engine import errors
from saga_engine.messages import Message

D = TypeVar("D", bound=BaseModel)

CommandFactory = Callable[[Any], Message]
ReplyHandler = Callable[[Any, Any], Any]
LocalAction = Callable[[Any, Session], Any]
Condition = Callable[[Any], bool]


class StepKind(enum.StrEnum):
    COMPENSATABLE = "compensatable"
    PIVOT = "pivot"
    RETRIABLE = "retriable"


class OnTimeout(enum.StrEnum):
    RETRY = "retry"  # send the same command again (the participant's inbox absorbs a duplicate)
    FAIL = "fail"  # treat the step as failed: compensate (or retry it, for a retriable step)


@dataclasses.dataclass(frozen=True)
class Invoke:
    """Send a command to a participant and wait for its reply."""

    participant: str
    command: CommandFactory
    reply: type[Message] | None = None


@dataclasses.dataclass(frozen=True)
class Local:
    """Run a function in the orchestrator's own transaction."""

    action: LocalAction


Action = Invoke | Local


@dataclasses.dataclass
class Step:
    """One step, built fluently with :func:`step`; frozen once given to a :class:`Saga`."""

    name: str
    action: Action | None = None
    compensation: Action | None = None
    reply_handler: ReplyHandler | None = None
    condition: Condition | None = None
    kind: StepKind | None = None
    timeout_seconds: float | None = None
    on_timeout: OnTimeout = OnTimeout.RETRY
    max_attempts: int | None = None

    # -- the fluent builder -----------------------------------------------------------------

    def invoke(
        self, participant: str, command: CommandFactory, reply: type[Message] | None = None
    ) -> Step:
        """The step sends ``command(data)`` to ``participant``; ``reply`` types its success reply."""
        self.action = Invoke(participant, command, reply)
        return self

    def local(self, action: LocalAction) -> Step:
        """The step runs ``action(data, session)`` in the orchestrator's transaction.

        It may return new saga data, and raise :class:`errors.Rejected` to fail the step.
        """
        self.action = Local(action)
        return self

    def compensate(
        self, participant_or_action: str | LocalAction, command: CommandFactory | None = None
    ) -> Step:
        """Undo the step: a participant command, or a local function ``(data, session)``."""
        if isinstance(participant_or_action, str):
            if command is None:
                raise errors.DefinitionError(
                    f"step {self.name!r}: compensate({participant_or_action!r}, ...) needs a command"
                )
            self.compensation = Invoke(participant_or_action, command)
        else:
            self.compensation = Local(participant_or_action)
        return self

    def on_reply(self, handler: ReplyHandler) -> Step:
        """``handler(data, reply)`` returns the new saga data after a successful reply."""
        self.reply_handler = handler
        return self

    def when(self, condition: Condition) -> Step:
        """Run the step only if ``condition(data)``; a skipped step is never compensated."""
        self.condition = condition
        return self

    def pivot(self) -> Step:
        """The point of no return: once it succeeds, the saga can only go forward."""
        self.kind = StepKind.PIVOT
        return self

    def retriable(self, max_attempts: int | None = None) -> Step:
        """After the pivot: retried on failure until it succeeds (or ``max_attempts``, then FAILED)."""
        self.kind = StepKind.RETRIABLE
        self.max_attempts = max_attempts
        return self

    def timeout(self, seconds: float, on_timeout: str | OnTimeout = OnTimeout.RETRY) -> Step:
        """No reply within ``seconds`` → send again (``retry``) or fail the step (``fail``)."""
        if seconds <= 0:
            raise errors.DefinitionError(f"step {self.name!r}: timeout must be positive")
        try:
            self.on_timeout = OnTimeout(on_timeout)
        except ValueError:
            raise errors.DefinitionError(
                f"step {self.name!r}: on_timeout must be 'retry' or 'fail', not {on_timeout!r}"
            ) from None
        self.timeout_seconds = seconds
        return self

    # -- what the engine asks ---------------------------------------------------------------

    @property
    def participants(self) -> set[str]:
        return {a.participant for a in (self.action, self.compensation) if isinstance(a, Invoke)}

    def applies_to(self, data: Any) -> bool:
        return self.condition is None or bool(self.condition(data))


def step(name: str) -> Step:
    """Start declaring a step."""
    return Step(name)


@dataclasses.dataclass(frozen=True)
class Retry:
    """Back-off of retried steps and compensations: min(cap, base·2^attempt) seconds."""

    base_seconds: float = 0.5
    cap_seconds: float = 60.0
    max_attempts: int = 8

    def delay(self, attempt: int) -> float:
        return float(min(self.cap_seconds, self.base_seconds * 2 ** max(0, attempt - 1)))


class Saga(Generic[D]):
    """A validated saga definition."""

    def __init__(
        self,
        name: str,
        *,
        data: type[D],
        steps: Sequence[Step],
        version: int = 1,
        retry: Retry | None = None,
    ) -> None:
        self.name = name
        self.data_type = data
        self.version = version
        self.retry = retry or Retry()
        self.steps: tuple[Step, ...] = tuple(steps)
        _validate(self)
        self.pivot_index = _pivot_index(self.steps)
        for index, s in enumerate(self.steps):
            if s.kind is None and index != self.pivot_index:
                after = index > self.pivot_index
                s.kind = StepKind.RETRIABLE if after else StepKind.COMPENSATABLE
            elif s.kind is None:
                s.kind = StepKind.PIVOT

    def __repr__(self) -> str:
        return f"Saga({self.name!r}, steps={[s.name for s in self.steps]})"

    @property
    def participants(self) -> set[str]:
        return set().union(*(s.participants for s in self.steps))

    @property
    def reply_channel(self) -> str:
        return f"{self.name}.replies"

    def step_named(self, name: str) -> Step:
        for s in self.steps:
            if s.name == name:
                return s
        raise errors.UnknownSaga(f"saga {self.name!r} has no step {name!r}")

    def index_of(self, name: str) -> int:
        return self.steps.index(self.step_named(name))


def _pivot_index(steps: Sequence[Step]) -> int:
    """The declared pivot, or else the last step before the first retriable one."""
    for index, s in enumerate(steps):
        if s.kind is StepKind.PIVOT:
            return index
    retriable = [i for i, s in enumerate(steps) if s.kind is StepKind.RETRIABLE]
    return (retriable[0] if retriable else len(steps)) - 1


#: The longest saga name: it is stored as the aggregate type of every command the saga sends.
MAX_SAGA_NAME = 64
#: The longest step name: a saga's state is a step's name, or ``compensate_`` and the name.
MAX_STEP_NAME = 128


def _validate(saga: Saga[Any]) -> None:
    def fail(problem: str, s: Step | None = None) -> None:
        where = f"saga {saga.name!r}" + (f", step {s.name!r}" if s else "")
        raise errors.DefinitionError(f"{where}: {problem}")

    if not saga.name or not saga.name.replace("_", "").replace("-", "").isalnum():
        fail("the name must be letters, digits, '_' or '-'")
    if len(saga.name) > MAX_SAGA_NAME:
        fail(f"the name has {len(saga.name)} characters, more than {MAX_SAGA_NAME}")
    if not (isinstance(saga.data_type, type) and issubclass(saga.data_type, BaseModel)):
        fail("data must be a pydantic model class")
    if not saga.steps:
        fail("a saga needs at least one step")
    seen: set[str] = set()
    for s in saga.steps:
        if not isinstance(s, Step):
            fail(f"steps must be made with step(...), got {type(s).__name__}")
        if s.name in seen:
            fail("duplicate step name", s)
        if not s.name or len(s.name) > MAX_STEP_NAME:
            fail(f"a step name needs 1 to {MAX_STEP_NAME} characters", s)
        seen.add(s.name)
        if s.action is None:
            fail("no action: call .invoke(participant, command) or .local(function)", s)
        if s.reply_handler is not None and not isinstance(s.action, Invoke):
            fail("on_reply needs an .invoke(...) step", s)
    pivots = [s for s in saga.steps if s.kind is StepKind.PIVOT]
    if len(pivots) > 1:
        fail(f"more than one pivot ({', '.join(p.name for p in pivots)})", pivots[1])
    pivot = _pivot_index(saga.steps)
    for index, s in enumerate(saga.steps):
        if index < pivot and s.kind is StepKind.RETRIABLE:
            fail("a retriable step must come after the pivot", s)
        if index < pivot and s.compensation is None:
            fail("a compensatable step before the pivot needs .compensate(...)", s)
        if s.on_timeout is OnTimeout.FAIL and (index >= pivot or s.compensation is None):
            fail("on_timeout='fail' needs a compensatable step (it may have committed)", s)
        if s.kind is StepKind.PIVOT and s.compensation is not None:
            fail("the pivot cannot be compensated: once it succeeds the saga only goes forward", s)
        if index > pivot and s.compensation is not None:
            fail("a step after the pivot cannot be compensated (make it .retriable())", s)
