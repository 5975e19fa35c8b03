"""The consuming loop shared by participants and orchestrators.

One pass polls a batch from the transport and applies it in ONE local transaction: for each message,
decode it, record it in the inbox (skip and count it if it was seen before), run the handler, which
writes its effects and its outgoing messages (outbox) on the same connection. A handler may bring a
batch scope that opens around all of the batch's handler calls (the orchestrator reads the batch's
sagas in one statement there, and writes their states and commands in one statement each when it
closes). Only after that transaction commits is the broker position committed. A crash anywhere
replays the batch; the inbox turns the replay into no-ops.

A message that cannot be decoded goes to the dead letters in the same transaction. When a handler
raises, the batch is rolled back and re-applied one message per transaction, in order, up to the
failing one: the ones before it are committed, it and the ones after it are released and come again
(order per key is kept; the failing one blocks its channel until it succeeds or is given up after
``max_attempts``, when ``give_up`` decides what happens, by default a dead letter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from sqlalchemy import Connection, Engine, exc

from saga_engine import clock, db, deadletter, errors
from saga_engine.inbox import Inbox
from saga_engine.messages import Envelope
from saga_engine.transport.base import Consumer, Delivery, Transport

log = logging.getLogger(__name__)

Handler = Callable[[Connection, Envelope], None]
GiveUp = Callable[[Connection, Envelope, BaseException], None]
DedupeKey = Callable[[Envelope], str]
#: Opens around the handler calls of one transaction, given the messages they will handle; what it
#: saved up (writes common to the batch) it writes when the block ends, before the commit.
BatchScope = Callable[[Connection, Sequence[Envelope]], AbstractContextManager[object]]


def no_batch_scope(
    conn: Connection, envelopes: Sequence[Envelope]
) -> AbstractContextManager[object]:
    return contextlib.nullcontext()


def by_message_id(envelope: Envelope) -> str:
    return envelope.message_id


DEFAULT_MAX_MESSAGE_BYTES = 1_048_576 + 64 * 1024  # the payload limit plus envelope fields


@dataclasses.dataclass
class ConsumerStats:
    processed: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    retries: int = 0
    given_up: int = 0


@dataclasses.dataclass
class _Cursor:
    """The index of the delivery a batch has in hand (-1 before the first)."""

    index: int = -1


@dataclasses.dataclass
class ConsumerConfig:
    batch_size: int = 200
    poll_timeout: float = 0.5
    max_attempts: int = 5
    retry_delay: float = 0.2
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES


class MessageConsumer:
    """Runs ``handler`` once in effect for every message on ``channels``."""

    def __init__(
        self,
        name: str,
        engine: Engine,
        transport: Transport,
        channels: Sequence[str],
        handler: Handler,
        *,
        give_up: GiveUp | None = None,
        dedupe_key: DedupeKey = by_message_id,
        batch: BatchScope = no_batch_scope,
        on_commit: Callable[[], None] | None = None,
        config: ConsumerConfig | None = None,
        clock: clock.Clock = clock.SYSTEM,
    ) -> None:
        self.name = name
        self.engine = engine
        self.transport = transport
        self.channels = list(channels)
        self.handler = handler
        self.give_up = give_up or self._dead_letter_give_up
        # What the inbox deduplicates on: the message id, or e.g. a command id that stays the
        # same when a command is sent again after a timeout.
        self.dedupe_key = dedupe_key
        # The handler's own batching (Orchestrator.batch, ParticipantService.batch).
        self.batch = batch
        # Called after each local commit: a relay in this process can deliver the new outbox rows
        # at once instead of at its next poll (databases without LISTEN/NOTIFY).
        self.on_commit = on_commit or (lambda: None)
        self.config = config or ConsumerConfig()
        self.clock = clock
        self.inbox = Inbox(clock)
        # Every handler runs in a savepoint: two statements per message, worth sending cheaply.
        # db.create_engine's engines send them so already; an engine made elsewhere learns it here.
        db.fast_savepoints(engine)
        self.stats = ConsumerStats()
        self._attempts: dict[str, int] = {}
        self._consumer: Consumer | None = None

    @property
    def consumer(self) -> Consumer:
        if self._consumer is None:
            self._consumer = self.transport.consumer(self.name, self.channels)
        return self._consumer

    def run_once(self) -> int:
        """Poll and apply one batch; returns how many deliveries it handled."""
        deliveries = self.consumer.poll(self.config.batch_size, self.config.poll_timeout)
        if deliveries:
            self.apply(deliveries)
        return len(deliveries)

    def apply(self, deliveries: Sequence[Delivery]) -> None:
        cursor = _Cursor()
        try:
            with self.engine.begin() as conn:
                self._apply_batch(conn, deliveries, cursor)
        except (exc.OperationalError, exc.InterfaceError):
            # The database itself is away: nothing was committed; let the deliveries come again.
            self.consumer.release(deliveries)
            raise
        except Exception as error:
            log.info("batch of %d failed (%s); applying one by one", len(deliveries), error)
            # The first message of a batch ran exactly as it would alone: that run counts as its
            # attempt, so a handler that keeps failing runs max_attempts times, not twice that.
            self._apply_singly(deliveries, error if cursor.index == 0 else None)
            return
        self.on_commit()
        self.consumer.commit(deliveries)

    def _apply_batch(
        self, conn: Connection, deliveries: Sequence[Delivery], cursor: _Cursor
    ) -> None:
        """Apply ``deliveries`` in ``conn``'s transaction, recording the inbox in one statement.

        The handler calls run inside the ``batch`` scope, which reads what they share up front
        and writes what they saved up when it closes, still in this transaction.

        ``cursor`` tells the caller which delivery was in hand if this raises (-1: none of them,
        the batch's inbox record or the scope's own writes failed).
        """
        decoded = [(delivery, self._decode(conn, delivery)) for delivery in deliveries]
        keys = [self.dedupe_key(envelope) for _, envelope in decoded if envelope is not None]
        first_times = iter(self.inbox.first_times(conn, self.name, keys) if keys else ())
        new: list[tuple[int, Delivery, Envelope]] = []
        for index, (delivery, envelope) in enumerate(decoded):
            if envelope is None:
                continue  # dead-lettered by _decode
            if next(first_times):
                new.append((index, delivery, envelope))
            else:
                self.stats.duplicates += 1
        with self.batch(conn, [envelope for _, _, envelope in new]):
            for index, delivery, envelope in new:
                cursor.index = index
                self._handle(conn, delivery, envelope)
            cursor.index = -1  # what the scope writes on leaving is no one message's

    def _apply_singly(
        self, deliveries: Sequence[Delivery], first_error: Exception | None = None
    ) -> None:
        for index, delivery in enumerate(deliveries):
            try:
                if index == 0 and first_error is not None:
                    raise first_error
                with self.engine.begin() as conn:
                    self._apply_one(conn, delivery)
            except Exception as error:
                try:
                    retry = self._retry_later(delivery, error)
                except Exception:
                    self.consumer.release(deliveries[index:])  # the database is away: retry all
                    raise
                if not retry:
                    continue
                self.on_commit()
                try:
                    self.consumer.commit(deliveries[:index])
                finally:
                    # Even when the commit fails (a rebalance): a consumer that keeps its
                    # partitions reads on from its position, past the message to retry, and its
                    # next commit would cover that message too.
                    self.consumer.release(deliveries[index:])
                time.sleep(self.config.retry_delay)
                return
        self.on_commit()
        self.consumer.commit(deliveries)

    def _retry_later(self, delivery: Delivery, error: BaseException) -> bool:
        """Count a failed attempt; once attempts run out, give up in a transaction of its own."""
        envelope = Envelope.from_wire(delivery.value)
        attempts = self._attempts.get(envelope.message_id, 0) + 1
        self._attempts[envelope.message_id] = attempts
        if attempts < self.config.max_attempts:
            self.stats.retries += 1
            log.warning(
                "%s: %s failed (attempt %d of %d): %s",
                self.name,
                envelope.message_type,
                attempts,
                self.config.max_attempts,
                error,
            )
            return True
        with self.engine.begin() as conn:
            if self.inbox.first_time(conn, self.name, self.dedupe_key(envelope)):
                self.give_up(conn, envelope, error)
        self._attempts.pop(envelope.message_id, None)
        self.stats.given_up += 1
        return False

    def apply_one(self, conn: Connection, delivery: Delivery) -> None:
        """Apply one delivery inside ``conn``'s transaction without acknowledging it (the fault
        simulator uses this to crash between the local commit and the broker commit)."""
        self._apply_one(conn, delivery)

    def _apply_one(self, conn: Connection, delivery: Delivery) -> None:
        envelope = self._decode(conn, delivery)
        if envelope is None:
            return
        if not self.inbox.first_time(conn, self.name, self.dedupe_key(envelope)):
            self.stats.duplicates += 1
            return
        with self.batch(conn, [envelope]):
            self._handle(conn, delivery, envelope)

    def _handle(self, conn: Connection, delivery: Delivery, envelope: Envelope) -> None:
        """Run the handler of a message recorded in the inbox for the first time."""
        try:
            self.handler(conn, envelope)
        except errors.Undeliverable as error:
            # Handlers raise this before writing anything, so the dead letter is all that commits.
            self.dead_letter(conn, delivery.channel, delivery.value, str(error), envelope)
            return
        self.stats.processed += 1

    def _decode(self, conn: Connection, delivery: Delivery) -> Envelope | None:
        try:
            if len(delivery.value) > self.config.max_message_bytes:
                raise errors.DecodeError(
                    f"message of {len(delivery.value)} bytes exceeds {self.config.max_message_bytes}"
                )
            return Envelope.from_wire(delivery.value)
        except errors.DecodeError as error:
            self.dead_letter(conn, delivery.channel, delivery.value, str(error))
            return None

    def dead_letter(
        self,
        conn: Connection,
        channel: str,
        raw: bytes,
        reason: str,
        envelope: Envelope | None = None,
    ) -> None:
        log.warning("%s: dead letter on %s: %s", self.name, channel, reason)
        deadletter.record(
            conn,
            consumer=self.name,
            channel=channel,
            raw=raw,
            reason=reason,
            message_id=envelope.message_id if envelope else None,
            message_type=envelope.message_type if envelope else None,
            now_clock=self.clock,
        )
        self.stats.dead_letters += 1

    def _dead_letter_give_up(
        self, conn: Connection, envelope: Envelope, error: BaseException
    ) -> None:
        self.dead_letter(
            conn,
            envelope.destination,
            envelope.to_wire(),
            f"gave up after {self.config.max_attempts} attempts: {error}",
            envelope,
        )

    def run(self, stop: threading.Event) -> None:
        """Consume until ``stop`` is set; database outages are waited out."""
        failures = 0
        try:
            while not stop.is_set():
                try:
                    self.run_once()
                    failures = 0
                except (exc.OperationalError, exc.InterfaceError, errors.TransportError) as error:
                    # A deadlock victim should retry at once; a database that is away, a little
                    # later each time. Long sleeps would also keep a Kafka consumer from polling
                    # past its max_poll_interval and cost it its partitions.
                    failures += 1
                    log.warning("%s: %s; retrying", self.name, str(error).splitlines()[0])
                    stop.wait(min(2.0, 0.05 * 2**failures))
        finally:
            self.close()

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
