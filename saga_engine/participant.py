"""Participants: the services whose local transactions are the saga's steps.

    inventory = Participant("inventory")

    @inventory.handles(ReserveStock)
    def reserve(cmd: ReserveStock, tx: Session) -> StockReserved:
        ...   # raise Rejected("out of stock") to fail the step

A handler runs in a local transaction of the participant's own database, with the inbox record of
the command and the reply (written to the participant's own outbox) in the same transaction. A
:class:`errors.Rejected` rolls back the handler's writes (a savepoint) and sends a failure reply;
any other exception is transient: the command is tried again with back-off, and after the last
attempt a failure reply is sent, so the saga never waits forever.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pydantic
import sqlalchemy as sa
from sqlalchemy import Connection
from sqlalchemy.orm import Session

from saga_engine import clock, db, deadletter, errors
from saga_engine.messages import Envelope, Message
from saga_engine.outbox.writer import OutboxWriter, PendingMessages

C = TypeVar("C", bound=Message)
CommandHandler = Callable[[Any, Session], Message | None]

REPLY_HEADERS = ("saga_type", "saga_id", "step", "phase", "command_id")
#: The longest participant name: its consumer records the inbox as ``participant:<name>``.
MAX_PARTICIPANT_NAME = 116


#: The replies of the batch open in this thread, with the connection of its transaction.
_REPLIES: contextvars.ContextVar[tuple[Connection, PendingMessages] | None] = (
    contextvars.ContextVar("saga_engine_participant_replies", default=None)
)


class Failure(Message):
    """The payload of a failure reply."""

    reason: str


@dataclasses.dataclass(frozen=True)
class _Handler:
    command_type: type[Message]
    function: CommandHandler


class Participant:
    """A service's command handlers, declared in its module."""

    def __init__(self, name: str, *, metadata: sa.MetaData | None = None) -> None:
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise errors.DefinitionError(f"participant name {name!r}: letters, digits, '_' or '-'")
        if len(name) > MAX_PARTICIPANT_NAME:
            raise errors.DefinitionError(
                f"participant name {name[:20]!r}...: {len(name)} characters, more than "
                f"{MAX_PARTICIPANT_NAME}"
            )
        self.name = name
        self.metadata = metadata  # the service's own tables (App.create_tables creates them)
        self.handlers: dict[str, _Handler] = {}

    def __repr__(self) -> str:
        return f"Participant({self.name!r}, handles={sorted(self.handlers)})"

    @property
    def channel(self) -> str:
        return f"{self.name}.commands"

    def handles(self, command_type: type[C]) -> Callable[[Callable[[C, Session], Any]], Any]:
        """Register the decorated function as the handler of ``command_type``."""

        def register(function: Callable[[C, Session], Any]) -> Any:
            if command_type.message_type in self.handlers:
                raise errors.DefinitionError(
                    f"participant {self.name!r} handles {command_type.message_type} twice"
                )
            self.handlers[command_type.message_type] = _Handler(command_type, function)
            return function

        return register


class ParticipantService:
    """Runs a participant's handlers for the messages of its channel (a consumer's handler)."""

    def __init__(
        self, participant: Participant, *, writer: OutboxWriter, clock: clock.Clock = clock.SYSTEM
    ) -> None:
        self.participant = participant
        self.writer = writer
        self.clock = clock

    @property
    def consumer_name(self) -> str:
        return f"participant:{self.participant.name}"

    @staticmethod
    def dedupe_key(envelope: Envelope) -> str:
        """A command sent again after a timeout has a new message id but the same command id."""
        return envelope.headers.get("command_id") or envelope.message_id

    @contextlib.contextmanager
    def batch(self, conn: Connection, envelopes: Sequence[Envelope]) -> Iterator[None]:
        """Handle the commands ``envelopes`` with :meth:`handle` inside this block, as one unit:
        their replies are written to the outbox with one insert when it ends, in ``conn``'s
        transaction. Messages a handler adds itself are written at once, inside its savepoint,
        so a rejection still takes them back. If the block raises, no reply is written."""
        replies = self.writer.pending()
        token = _REPLIES.set((conn, replies))
        try:
            yield
            replies.write(conn)
        finally:
            _REPLIES.reset(token)

    def handle(self, conn: Connection, envelope: Envelope) -> None:
        missing = [h for h in (*REPLY_HEADERS, "reply_to") if h not in envelope.headers]
        if missing:
            raise errors.Undeliverable(f"not a saga command: headers {missing} missing")
        try:
            command = self._decode(envelope)
        except errors.DecodeError as error:
            # The saga must hear about it, or it would wait forever: reply failure, keep the letter.
            deadletter.record(
                conn,
                consumer=self.consumer_name,
                channel=envelope.destination,
                raw=envelope.to_wire(),
                reason=str(error),
                message_id=envelope.message_id,
                message_type=envelope.message_type,
                now_clock=self.clock,
            )
            self.reply(conn, envelope, None, str(error))
            return
        handler = self.participant.handlers[envelope.message_type]
        try:
            # The savepoint is what a rejection rolls back: the inbox record and the failure
            # reply still commit with the consumer's transaction.
            with db.session_in_savepoint(conn) as session:
                result = handler.function(command, session)
        except errors.Rejected as rejected:
            self.reply(conn, envelope, None, str(rejected))
            return
        self.reply(conn, envelope, result, None)

    def give_up(self, conn: Connection, envelope: Envelope, error: BaseException) -> None:
        """Transient errors outlasted every attempt: tell the saga the step failed."""
        self.reply(conn, envelope, None, f"gave up after repeated errors: {error}")

    def _decode(self, envelope: Envelope) -> Message:
        handler = self.participant.handlers.get(envelope.message_type)
        if handler is None:
            raise errors.DecodeError(
                f"participant {self.participant.name!r} has no handler for {envelope.message_type}"
            )
        try:
            return handler.command_type.model_validate(envelope.payload)
        except pydantic.ValidationError as error:
            raise errors.DecodeError(
                f"{envelope.message_type} does not match its schema: {error.error_count()} error(s)"
            ) from error

    def reply(
        self, conn: Connection, command: Envelope, result: Message | None, failure: str | None
    ) -> None:
        """Write the reply to this service's outbox, in the handler's transaction."""
        payload: Message | None = Failure(reason=failure[:2000]) if failure is not None else result
        headers = {h: command.headers[h] for h in REPLY_HEADERS}
        headers["outcome"] = "failure" if failure is not None else "success"
        self._send(
            conn,
            Envelope(
                message_type=payload.message_type if payload is not None else "Success",
                destination=command.headers["reply_to"],
                partition_key=command.partition_key,
                aggregate_type=command.aggregate_type,
                aggregate_id=command.aggregate_id,
                correlation_id=command.correlation_id,
                causation_id=command.message_id,
                tenant_id=command.tenant_id,
                headers=headers,
                payload=payload.model_dump(mode="json") if payload is not None else {},
            ),
        )

    def _send(self, conn: Connection, reply: Envelope) -> None:
        """Write ``reply`` now, or with the batch's other replies if a batch is open on ``conn``."""
        batch = _REPLIES.get()
        if batch is not None and batch[0] is conn:
            batch[1].add(reply)
        else:
            self.writer.add(conn, reply)
