"""A saga definition compiled to a ``transitions`` state machine.

States: ``STARTED``; one forward state per step (named after the step: the saga is running it or
waiting for its reply); ``compensate_<step>`` for each step with a compensation; and the terminal
``COMPLETED``, ``COMPENSATED`` and ``FAILED``.

Triggers: ``begin``, ``proceed`` (step succeeded), ``fail`` (step failed before or at the pivot),
``retry`` (send again: a timeout, a retriable step, a failed compensation), ``compensated`` (one
compensation done) and ``give_up`` (needs an operator). Where conditional steps make the next state
depend on the saga's data, one trigger has several destinations; the orchestrator names the one it
wants (``target``) and the machine accepts it only if the definition allows that edge. So the machine
is the single authority on which moves are legal, and the diagrams drawn from it are the truth.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from transitions import EventData, Machine

from saga_engine import errors
from saga_engine.definition import Invoke, OnTimeout, Saga, Step, StepKind

STARTED = "STARTED"
COMPLETED = "COMPLETED"
COMPENSATED = "COMPENSATED"
FAILED = "FAILED"
TERMINAL = frozenset({COMPLETED, COMPENSATED, FAILED})


def compensating(step_name: str) -> str:
    return f"compensate_{step_name}"


class TargetIs:
    """Transition condition: the orchestrator asked for this destination."""

    def __init__(self, dest: str) -> None:
        self.dest = dest

    def __call__(self, event: EventData) -> bool:
        return bool(event.kwargs.get("target") == self.dest)


class SagaCursor:
    """The model the machine moves: only a state (the instance itself lives in the database)."""

    state: str = STARTED


class SagaMachine(Machine):
    """The compiled machine of one saga definition."""

    def __init__(self, saga: Saga[Any]) -> None:
        self.saga = saga
        super().__init__(
            model=None,
            states=state_names(saga),
            transitions=list(edges(saga)),
            initial=STARTED,
            auto_transitions=False,
            send_event=True,
        )
        self._local = threading.local()
        # Moves the machine has allowed. Its answer for a (state, trigger, target) never changes:
        # the only conditions are TargetIs, and nothing adds states or transitions after this.
        # Asking ``transitions`` again cost every saga move about 8 % of a worker's time.
        self._allowed: set[tuple[str, str, str]] = set()

    def fire(self, state: str, trigger: str, target: str) -> str:
        """Move from ``state`` by ``trigger`` to ``target``, or raise if the definition forbids it."""
        move = (state, trigger, target)
        if move not in self._allowed:
            self._ask(*move)
            self._allowed.add(move)
        return target

    def _ask(self, state: str, trigger: str, target: str) -> None:
        """Run the move on ``transitions``; raise if it does not end in ``target``."""
        cursor = self._cursor()
        self.set_state(state, model=cursor)
        event = self.events.get(trigger)
        try:
            moved = event is not None and event.trigger(cursor, target=target)
        except Exception as error:  # transitions raises MachineError for a trigger invalid here
            raise errors.InvalidTransition(
                f"saga {self.saga.name!r}: {trigger} from {state} is not allowed"
            ) from error
        if not moved or cursor.state != target:
            raise errors.InvalidTransition(
                f"saga {self.saga.name!r}: {trigger} from {state} cannot lead to {target}"
            )

    def _cursor(self) -> SagaCursor:
        cursor: SagaCursor | None = getattr(self._local, "cursor", None)
        if cursor is None:
            cursor = SagaCursor()
            self.add_model(cursor, initial=STARTED)
            self._local.cursor = cursor
        return cursor


def state_names(saga: Saga[Any]) -> list[str]:
    forward = [s.name for s in saga.steps]
    backward = [
        compensating(s.name)
        for s in saga.steps
        if s.compensation is not None and saga.index_of(s.name) < saga.pivot_index
    ]
    return [STARTED, *forward, *backward, COMPLETED, COMPENSATED, FAILED]


def edges(saga: Saga[Any]) -> Iterable[dict[str, Any]]:
    """Every legal move of ``saga``."""
    steps = saga.steps
    yield from _edges("begin", STARTED, _forward_targets(steps, 0))
    for index, s in enumerate(steps):
        yield from _edges("proceed", s.name, _forward_targets(steps, index + 1))
        if index <= saga.pivot_index:
            # A step that times out with on_timeout="fail" may still have committed: its own
            # compensation runs first.
            undo_from = index + 1 if s.on_timeout is OnTimeout.FAIL else index
            yield from _edges("fail", s.name, _compensation_targets(saga, undo_from))
        if _may_retry(s):
            yield from _edges("retry", s.name, [s.name])
        yield from _edges("give_up", s.name, [FAILED])
        if compensating(s.name) in state_names(saga):
            undo = compensating(s.name)
            yield from _edges("compensated", undo, _compensation_targets(saga, index))
            yield from _edges("retry", undo, [undo])
            yield from _edges("give_up", undo, [FAILED])


def _edges(trigger: str, source: str, targets: Iterable[str]) -> Iterable[dict[str, Any]]:
    for dest in dict.fromkeys(targets):  # ordered, no repeats
        yield {"trigger": trigger, "source": source, "dest": dest, "conditions": [TargetIs(dest)]}


def _forward_targets(steps: tuple[Step, ...], start: int) -> list[str]:
    """The next step from ``start`` on, or any later one if the ones between may be skipped."""
    targets = []
    for s in steps[start:]:
        targets.append(s.name)
        if s.condition is None:
            return targets
    return [*targets, COMPLETED]


def _compensation_targets(saga: Saga[Any], failed_index: int) -> list[str]:
    """Where compensation starts when step ``failed_index`` failed (or was just compensated)."""
    targets = []
    for s in reversed(saga.steps[:failed_index]):
        if s.compensation is None:
            continue
        targets.append(compensating(s.name))
        if s.condition is None:
            return targets
    return [*targets, COMPENSATED]


def _may_retry(s: Step) -> bool:
    timed_retry = s.timeout_seconds is not None and s.on_timeout is OnTimeout.RETRY
    return s.kind is StepKind.RETRIABLE or (isinstance(s.action, Invoke) and timed_retry)
