"""Drives saga instances: applies replies and deadlines, emits the next commands.

Every move is one local transaction on the orchestrator's database: read the instance, apply the
reply (or the deadline), run any local steps, write the next command to the outbox, save the instance
with its version check. The consumer loop around :meth:`Orchestrator.on_reply` adds the inbox
record to the same transaction, so a duplicate reply changes nothing. It applies a whole batch of
replies in one transaction inside :meth:`Orchestrator.batch`, which reads their sagas with one
statement and writes their commands and new states with one statement each; a batch that fails
is applied again one reply per transaction.

Forward, the saga runs its steps in order, skipping those whose condition is false; the compensatable
steps that commit are remembered. When a step at or before the pivot fails, the remembered steps are
compensated in reverse, one at a time, each waiting for its reply. Failed compensations and failed
retriable steps are sent again after a back-off stored as a deadline; when the attempts run out the
saga is FAILED with its error, for an operator to see in ``saga-engine status``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel
from sqlalchemy import Connection

from saga_engine import clock, db, errors, ids, store
from saga_engine.definition import Action, Invoke, Local, OnTimeout, Saga, Step, StepKind
from saga_engine.machine import (
    COMPENSATED,
    COMPLETED,
    FAILED,
    STARTED,
    TERMINAL,
    SagaMachine,
    compensating,
)
from saga_engine.messages import Envelope
from saga_engine.outbox import writer as outbox_writer
from saga_engine.outbox.writer import OutboxWriter, PendingMessages
from saga_engine.store import SagaInstance

log = logging.getLogger(__name__)

DO, UNDO = "do", "undo"
SUCCESS, FAILURE = "success", "failure"
TIMEOUT, RETRY = "timeout", "retry"
_COMMAND_IDS = uuid.UUID("6f1c2a52-8a53-4d8e-9f6e-2c1d4d6b9a10")


#: The id of the saga whose local step is running (for logging, or keys in the step's own rows).
CURRENT_SAGA: contextvars.ContextVar[str] = contextvars.ContextVar("saga_engine_current_saga")


@dataclasses.dataclass
class _Batch:
    """The replies of one consumed batch, applied in one transaction (see Orchestrator.batch)."""

    conn: Connection
    instances: dict[str, SagaInstance]
    commands: PendingMessages
    #: The sagas the batch changed, with the version each was read at.
    read_versions: dict[str, int] = dataclasses.field(default_factory=dict)


#: The batch open in this thread, if any. Consumers run in threads of their own, and the batch
#: also names its connection: any other transaction of the thread reads and writes directly.
_BATCH: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar(
    "saga_engine_orchestrator_batch", default=None
)


def current_saga_id() -> str:
    """Inside a local step or local compensation: the id of its saga."""
    return CURRENT_SAGA.get()


def command_channel(participant: str) -> str:
    return f"{participant}.commands"


def command_id(saga_id: str, step: str, phase: str, attempt: int) -> str:
    """Deterministic: the same command sent again (after a timeout) keeps its id, so the
    participant's inbox recognises it; a new attempt after a failure gets a new one."""
    return str(uuid.uuid5(_COMMAND_IDS, f"{saga_id}/{step}/{phase}/{attempt}"))


class Orchestrator:
    def __init__(
        self,
        sagas: dict[str, Saga[Any]],
        *,
        writer: OutboxWriter,
        clock: clock.Clock = clock.SYSTEM,
    ) -> None:
        self.sagas = sagas
        self.machines = {name: SagaMachine(saga) for name, saga in sagas.items()}
        self.writer = writer
        self.clock = clock

    # -- entry points ---------------------------------------------------------------------------

    def start(
        self,
        conn: Connection,
        saga: Saga[Any],
        data: BaseModel | dict[str, Any],
        *,
        saga_id: str | None = None,
        tenant_id: str | None = None,
    ) -> str:
        """Create a saga instance in the caller's transaction and send its first command."""
        model = data if isinstance(data, saga.data_type) else saga.data_type.model_validate(data)
        instance = SagaInstance(
            id=saga_id or ids.new_id(),
            saga_type=saga.name,
            definition_version=saga.version,
            state=STARTED,
            data=model.model_dump(mode="json"),
            tenant_id=tenant_id,
        )
        commands = self.writer.pending()
        _Run(self, conn, saga, instance, cause=None, commands=commands).forward("begin", 0)
        self._insert_new(conn, instance, commands)
        return instance.id

    def _insert_new(
        self, conn: Connection, instance: SagaInstance, commands: PendingMessages
    ) -> None:
        """Write a new saga's row and the command its first steps sent (none if they were all
        local). On PostgreSQL the row rides in the command's insert (:data:`_START`)."""
        now = self.clock.now()
        if len(commands.rows) == 1 and conn.dialect.name == "postgresql":
            _START.execute(conn, {**commands.rows[0], **store.carried_row(instance, now)})
            return
        commands.write(conn)
        store.insert(conn, instance, now)

    @contextlib.contextmanager
    def batch(self, conn: Connection, envelopes: Sequence[Envelope]) -> Iterator[None]:
        """Apply the replies ``envelopes`` with :meth:`on_reply` inside this block, as one unit.

        Their sagas are read with one statement when the block begins; the commands they send and
        their new states are written with one statement each when it ends, still inside ``conn``'s
        transaction, so they commit together with everything else the replies did. If the block
        raises, nothing is written (the caller rolls the transaction back). A saga another worker
        changed meanwhile fails the whole block with :class:`errors.ConcurrentUpdate`.
        """
        ids = [e.headers["saga_id"] for e in envelopes if isinstance(e.headers.get("saga_id"), str)]
        batch = _Batch(conn, store.load_many(conn, ids), self.writer.pending())
        token = _BATCH.set(batch)
        try:
            yield
            batch.commands.write(conn)
            changed = [(batch.instances[i], v) for i, v in batch.read_versions.items()]
            store.save_many(conn, changed, self.clock.now())
        finally:
            _BATCH.reset(token)

    def on_reply(self, conn: Connection, envelope: Envelope) -> None:
        """Apply one participant reply (the handler of the orchestrator's consumer)."""
        saga, instance = self._awaiting(conn, envelope)
        run = _Run(self, conn, saga, instance, cause=envelope.message_id)
        step = saga.step_named(envelope.headers["step"])
        succeeded = envelope.headers.get("outcome") == SUCCESS
        reason = str(envelope.payload.get("reason", "failed"))
        if envelope.headers.get("phase") == UNDO:
            run.compensation_replied(step, succeeded, reason)
        elif succeeded:
            run.step_succeeded(step, envelope.payload)
        else:
            run.step_failed(step, reason)
        self._save(conn, instance)

    def on_deadline(self, conn: Connection, saga_id: str) -> bool:
        """Act on a passed deadline (timeout or back-off); False if it was not due after all."""
        instance = self._load(conn, saga_id)
        now = self.clock.now()
        if instance is None or instance.deadline is None or instance.deadline > now:
            return False
        saga = self._saga(instance.saga_type)
        _Run(self, conn, saga, instance, cause=None).deadline_passed()
        self._save(conn, instance)
        return True

    def give_up(self, conn: Connection, envelope: Envelope, error: BaseException) -> None:
        """The reply could not be applied after every attempt: the saga needs an operator."""
        self.fail(
            conn,
            envelope.headers.get("saga_id", ""),
            f"applying {envelope.message_type} failed: {error}",
            cause=envelope.message_id,
        )

    def fail(self, conn: Connection, saga_id: str, error: str, cause: str | None = None) -> None:
        """Move a saga to FAILED with ``error``, for an operator (no-op if it has ended)."""
        instance = self._load(conn, saga_id)
        if instance is None or instance.state in TERMINAL:
            return
        _Run(self, conn, self._saga(instance.saga_type), instance, cause=cause).fail_saga(error)
        self._save(conn, instance)

    # -- reading and writing instances ------------------------------------------------------------

    def _load(self, conn: Connection, saga_id: str) -> SagaInstance | None:
        batch = _open_batch(conn)
        if batch is None:
            return store.load(conn, saga_id)
        if saga_id not in batch.instances:  # not among the batch's replies: read it now
            instance = store.load(conn, saga_id)
            if instance is None:
                return None
            batch.instances[saga_id] = instance
        return batch.instances[saga_id]

    def _save(self, conn: Connection, instance: SagaInstance) -> None:
        batch = _open_batch(conn)
        if batch is None:
            store.save(conn, instance, self.clock.now())
        else:
            # Saved at the end of the batch, checked against the version first read.
            batch.read_versions.setdefault(instance.id, instance.version)

    # -- checks ---------------------------------------------------------------------------------

    def _saga(self, name: str) -> Saga[Any]:
        saga = self.sagas.get(name)
        if saga is None:
            raise errors.Undeliverable(f"unknown saga type {name!r}")
        return saga

    def _awaiting(self, conn: Connection, envelope: Envelope) -> tuple[Saga[Any], SagaInstance]:
        headers = envelope.headers
        missing = {"saga_type", "saga_id", "step", "phase", "command_id", "outcome"} - set(headers)
        if missing:
            raise errors.Undeliverable(f"not a saga reply: headers {sorted(missing)} missing")
        saga = self._saga(headers["saga_type"])
        instance = self._load(conn, headers["saga_id"])
        if instance is None:
            raise errors.Undeliverable(f"unknown saga id {headers['saga_id']!r}")
        if instance.state in TERMINAL:
            raise errors.Undeliverable(f"reply for saga {instance.id} that is {instance.state}")
        if headers["command_id"] != instance.command_id:
            raise errors.Undeliverable(
                f"stale reply: saga {instance.id} in {instance.state} is not waiting for "
                f"{headers['step']}/{headers['phase']} command {headers['command_id']}"
            )
        return saga, instance


#: A new saga's row and its first command in one statement, the row's insert as a data-modifying
#: ``WITH`` (PostgreSQL): the caller's transaction that starts a saga then makes one round trip
#: to the database instead of two, and the server runs one statement. Both rows or neither.
_START = db.DriverStatement(
    outbox_writer.INSERT.add_cte(store.CARRIED_INSERT.cte("new_saga")),
    [*outbox_writer.COLUMNS, *store.CARRIED_KEYS],
)


def _open_batch(conn: Connection) -> _Batch | None:
    batch = _BATCH.get()
    return batch if batch is not None and batch.conn is conn else None


class _Run:
    """One transition of one instance, inside the caller's transaction."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        conn: Connection,
        saga: Saga[Any],
        instance: SagaInstance,
        cause: str | None,
        commands: PendingMessages | None = None,
    ) -> None:
        self.o = orchestrator
        self.conn = conn
        self.saga = saga
        self.instance = instance
        self.cause = cause
        #: Where the commands go to be written later: the caller's (a start writes them with the
        #: saga's row), else the open batch's; None writes each one at once.
        if commands is None and (batch := _open_batch(conn)) is not None:
            commands = batch.commands
        self.commands = commands
        self.machine = orchestrator.machines[saga.name]
        self.now = orchestrator.clock.now()

    # -- moves ----------------------------------------------------------------------------------

    def fire(self, trigger: str, target: str) -> None:
        self.instance.state = self.machine.fire(self.instance.state, trigger, target)
        if target in TERMINAL:
            self.instance.ended_at = self.now
            self.instance.command_id = None
            self.instance.wait_until(None, None)

    def forward(self, trigger: str, index: int) -> None:
        """Run steps from ``index`` on until one waits for a reply or the saga completes."""
        while True:
            step = self._next_applicable(index)
            if step is None:
                self.fire(trigger, COMPLETED)
                return
            if self.instance.state != step.name:
                self.instance.attempt = 0  # a retried local step keeps counting its attempts
            self.fire(trigger, step.name)
            assert step.action is not None
            if isinstance(step.action, Invoke):
                self.send(step, DO, step.action)
                return
            try:
                self.run_local(step.action)
            except errors.Rejected as rejected:
                self.step_failed(step, str(rejected))
                return
            self.remember(step)
            trigger, index = "proceed", self.saga.steps.index(step) + 1

    def backward(self, trigger: str) -> None:
        """Compensate the remembered steps in reverse until one waits for a reply, or all are done."""
        while True:
            if not self.instance.completed_steps:
                self.fire(trigger, COMPENSATED)
                return
            step = self.saga.step_named(self.instance.completed_steps[-1])
            self.fire(trigger, compensating(step.name))
            self.instance.attempt = 0
            if not self.compensate(step):
                return
            self.instance.completed_steps.pop()
            trigger = "compensated"

    def compensate(self, step: Step) -> bool:
        """Start ``step``'s compensation; True if it is already done (a local one)."""
        assert step.compensation is not None
        if isinstance(step.compensation, Invoke):
            self.send(step, UNDO, step.compensation)
            return False
        try:
            self.run_local(step.compensation)
        except errors.Rejected as rejected:
            self.compensation_replied(step, False, str(rejected))
            return False
        return True

    # -- outcomes -------------------------------------------------------------------------------

    def step_succeeded(self, step: Step, reply_payload: dict[str, Any]) -> None:
        assert isinstance(step.action, Invoke)
        if step.reply_handler is not None:
            reply: Any = reply_payload
            if step.action.reply is not None:
                reply = step.action.reply.model_validate(reply_payload)
            self.set_data(step.reply_handler(self.data(), reply))
        self.remember(step)
        self.forward("proceed", self.saga.steps.index(step) + 1)

    def step_failed(self, step: Step, reason: str) -> None:
        self.instance.last_error = f"{step.name}: {reason}"
        if step.kind is StepKind.RETRIABLE:
            self.retry_later(step, step.max_attempts, "step")
            return
        self.backward("fail")

    def compensation_replied(self, step: Step, succeeded: bool, reason: str) -> None:
        if succeeded:
            self.instance.completed_steps.pop()
            self.backward("compensated")
            return
        self.instance.last_error = f"compensation of {step.name}: {reason}"
        self.retry_later(step, self.saga.retry.max_attempts, "compensation")

    def retry_later(self, step: Step, max_attempts: int | None, what: str) -> None:
        """Send again after the back-off, or FAILED when the attempts are spent."""
        attempts = self.instance.attempt + 1
        if max_attempts is not None and attempts >= max_attempts:
            self.fail_saga(
                f"{what} {step.name} failed {attempts} times: {self.instance.last_error}"
            )
            return
        delay = self.saga.retry.delay(attempts)
        self.instance.command_id = None  # a late reply to the failed attempt is stale
        self.instance.wait_until(self.now + timedelta(seconds=delay), RETRY)

    def deadline_passed(self) -> None:
        instance, state = self.instance, self.instance.state
        kind = instance.deadline_kind
        instance.wait_until(None, None)
        undo = state.startswith("compensate_") and state not in {s.name for s in self.saga.steps}
        step = self.saga.step_named(state.removeprefix("compensate_") if undo else state)
        if kind == RETRY and not undo and isinstance(step.action, Local):
            instance.attempt += 1
            self.forward("retry", self.saga.steps.index(step))  # runs the local step again
        elif kind == RETRY:
            instance.attempt += 1
            self.fire("retry", state)
            action = step.compensation if undo else step.action
            if undo and isinstance(action, Local):
                if self.compensate(step):
                    instance.completed_steps.pop()
                    self.backward("compensated")
                return
            assert isinstance(action, Invoke)
            self.send(step, UNDO if undo else DO, action)
        elif step.on_timeout is OnTimeout.RETRY:
            self.fire("retry", state)
            assert isinstance(step.action, Invoke)
            self.send(step, DO, step.action)  # same attempt: same command id, deduplicated
        else:
            # The command may still be applied later: compensate this step too, to be safe.
            instance.last_error = f"{step.name}: no reply within {step.timeout_seconds} s"
            self.remember(step)
            self.backward("fail")

    def fail_saga(self, error: str) -> None:
        self.instance.last_error = error
        self.fire("give_up", FAILED)
        log.error("saga %s %s FAILED: %s", self.saga.name, self.instance.id, error)

    # -- helpers --------------------------------------------------------------------------------

    def send(self, step: Step, phase: str, action: Action) -> None:
        assert isinstance(action, Invoke)
        instance = self.instance
        command = action.command(self.data())
        cid = command_id(instance.id, step.name, phase, instance.attempt)
        instance.command_id = cid
        envelope = Envelope(
            message_type=command.message_type,
            destination=command_channel(action.participant),
            partition_key=instance.id,
            aggregate_type=self.saga.name,
            aggregate_id=instance.id,
            correlation_id=instance.id,
            causation_id=self.cause,
            tenant_id=instance.tenant_id,
            headers={
                "saga_type": self.saga.name,
                "saga_id": instance.id,
                "step": step.name,
                "phase": phase,
                "command_id": cid,
                "reply_to": self.saga.reply_channel,
            },
            payload=command.model_dump(mode="json"),
        )
        if self.commands is None:
            self.o.writer.add(self.conn, envelope)
        else:
            self.commands.add(envelope)
        deadline = self._timeout_deadline(step) if phase == DO else None
        instance.wait_until(deadline, TIMEOUT if deadline else None)

    def _timeout_deadline(self, step: Step) -> datetime | None:
        if step.timeout_seconds is None:
            return None
        return self.now + timedelta(seconds=step.timeout_seconds)

    def run_local(self, action: Action) -> None:
        """Run a local step in a savepoint, so a rejection undoes only its own writes."""
        assert isinstance(action, Local)
        data = self.data()
        token = CURRENT_SAGA.set(self.instance.id)
        try:
            with db.session_in_savepoint(self.conn) as session:
                result = action.action(data, session)
        finally:
            CURRENT_SAGA.reset(token)
        self.set_data(result if isinstance(result, BaseModel) else data)

    def remember(self, step: Step) -> None:
        index = self.saga.steps.index(step)
        done = self.instance.completed_steps
        if (
            step.compensation is not None
            and index < self.saga.pivot_index
            and step.name not in done
        ):
            done.append(step.name)

    def _next_applicable(self, index: int) -> Step | None:
        data = self.data()
        for step in self.saga.steps[index:]:
            if step.applies_to(data):
                return step
        return None

    def data(self) -> Any:
        return self.saga.data_type.model_validate(self.instance.data)

    def set_data(self, data: Any) -> None:
        if data is not None:
            self.instance.data = data.model_dump(mode="json")
