"""The message relay: claims outbox rows in batches, publishes them, marks the results.

One pass (:meth:`Relay.run_once`) is: claim up to ``batch_size`` rows (see ``claim``), publish them
all with one broker round trip, mark every acknowledged row SENT with one UPDATE, and give each
failed row ``retry_count + 1`` and an exponential, jittered ``next_retry_at`` (FAILED past
``max_retries``). Nothing is marked before the broker acknowledged it, so a relay killed at any
point loses nothing: whatever it had in flight is published again and the consumers' inbox absorbs
the duplicate.

The loop (:meth:`Relay.run`) repeats at once while batches come back full, and otherwise sleeps
until a NOTIFY wake-up (PostgreSQL), the poll interval, or a stop request, whichever comes first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine, exc

from saga_engine import clock, db, schema
from saga_engine.messages import wire_bytes
from saga_engine.outbox import claim as claims
from saga_engine.outbox.notify import Wakeup
from saga_engine.transport.base import OutgoingMessage, PublishResult, Transport

log = logging.getLogger(__name__)
t = schema.outbox


@dataclasses.dataclass(frozen=True)
class RelayConfig:
    """Relay tuning. ``batch_size`` ≈ peak rate × poll interval / relays (docs/outbox.md)."""

    batch_size: int = 500
    poll_interval: float = 0.5
    ack_timeout: float = 5.0
    max_retries: int = 10
    backoff_base: float = 1.0
    backoff_cap: float = 300.0
    jitter: float = 0.2
    claim: str = "auto"
    lease_seconds: float = 30.0
    pool_size: int = 2

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.poll_interval <= 0 or self.ack_timeout <= 0:
            raise ValueError("batch_size, poll_interval and ack_timeout must be positive")
        if self.max_retries < 1:
            raise ValueError("max_retries must be at least 1")

    def backoff(self, retry_count: int, rng: random.Random) -> float:
        """Seconds before attempt ``retry_count + 1``: min(cap, base·2^retry), ±jitter."""
        delay = min(self.backoff_cap, self.backoff_base * 2**retry_count)
        return delay * (1 + self.jitter * (2 * rng.random() - 1))


@dataclasses.dataclass
class RelayStats:
    """Counters since the relay started (monitoring signal: relay rate, failure rate)."""

    batches: int = 0
    published: int = 0
    retried: int = 0
    failed: int = 0
    errors: int = 0


@dataclasses.dataclass(frozen=True)
class BatchOutcome:
    published: int
    retried: int
    failed: int
    claimed: int


class Relay:
    """Moves outbox rows to a transport. Safe to run as many at once as you like."""

    def __init__(
        self,
        engine: Engine,
        transport: Transport,
        config: RelayConfig | None = None,
        *,
        clock: clock.Clock = clock.SYSTEM,
        wakeup: Wakeup | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.config = config or RelayConfig()
        self.clock = clock
        self.wakeup = wakeup
        self.rng = rng or random.Random()
        self.stats = RelayStats()
        self.strategy = claims.strategy_for(
            engine, self.config.claim, timedelta(seconds=self.config.lease_seconds)
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_database(
        cls, db_url: str, transport: Transport, config: RelayConfig | None = None, **kwargs: Any
    ) -> Relay:
        """A relay with its own small connection pool, apart from the application's (pit 3)."""
        config = config or RelayConfig()
        engine = db.create_engine(db_url, pool_size=config.pool_size)
        wakeup = kwargs.pop("wakeup", None) or Wakeup.for_engine(engine)
        return cls(engine, transport, config, wakeup=wakeup, **kwargs)

    # -- one pass ---------------------------------------------------------------------------

    def run_once(self) -> BatchOutcome:
        """Claim, publish and mark one batch."""
        now = self.clock.now()
        with self.strategy.claim(self.engine, self.config.batch_size, now) as batch:
            if not batch.rows:
                return BatchOutcome(0, 0, 0, 0)
            results = self.transport.publish(
                [to_outgoing(row) for row in batch.rows], self.config.ack_timeout
            )
            outcome = self._mark(batch, results)
        self._count(outcome)
        return outcome

    def _mark(self, batch: claims.Claim, results: Sequence[PublishResult]) -> BatchOutcome:
        now = self.clock.now()
        by_id = {row.message_id: row for row in batch.rows}
        sent = [by_id[r.message_id].id for r in results if r.ok]
        failures = [(by_id[r.message_id], r.error or "unknown") for r in results if not r.ok]
        if sent:
            batch.conn.execute(
                self._owned(sa.update(t).where(t.c.id.in_(sent)), batch.token).values(
                    status=schema.OutboxStatus.SENT,
                    sent_at=now,
                    updated_at=now,
                    claimed_by=None,
                    lease_until=None,
                )
            )
        retried = failed = 0
        if failures:
            rows = [self._failure_values(row, error, now) for row, error in failures]
            failed = sum(1 for r in rows if r["status"] == schema.OutboxStatus.FAILED)
            retried = len(rows) - failed
            batch.conn.execute(self._failure_statement(batch.token), rows)
        return BatchOutcome(len(sent), retried, failed, len(batch.rows))

    @staticmethod
    def _owned(stmt: sa.Update, token: str | None) -> sa.Update:
        # A leased row whose lease ran out may belong to another relay by now: leave it alone.
        return stmt if token is None else stmt.where(t.c.claimed_by == token)

    def _failure_statement(self, token: str | None) -> sa.Update:
        stmt = sa.update(t).where(t.c.id == sa.bindparam("row_id"))
        return self._owned(stmt, token).values(
            status=sa.bindparam("new_status"),
            retry_count=sa.bindparam("new_retry_count"),
            next_retry_at=sa.bindparam("new_next_retry_at"),
            last_error=sa.bindparam("new_last_error"),
            updated_at=sa.bindparam("new_updated_at"),
            claimed_by=None,
            lease_until=None,
        )

    def _failure_values(self, row: sa.Row[Any], error: str, now: datetime) -> dict[str, Any]:
        retry_count = row.retry_count + 1
        exhausted = retry_count >= self.config.max_retries
        delay = self.config.backoff(row.retry_count, self.rng)
        log.warning(
            "outbox message %s to %s failed (attempt %d): %s",
            row.message_id,
            row.destination,
            retry_count,
            error,
        )
        return {
            "row_id": row.id,
            "new_status": schema.OutboxStatus.FAILED if exhausted else schema.OutboxStatus.PENDING,
            "new_retry_count": retry_count,
            "new_next_retry_at": now + timedelta(seconds=delay),
            "new_last_error": error[:2000],
            "new_updated_at": now,
        }

    def _count(self, outcome: BatchOutcome) -> None:
        self.stats.batches += 1
        self.stats.published += outcome.published
        self.stats.retried += outcome.retried
        self.stats.failed += outcome.failed

    # -- the loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> None:
        """Relay until ``stop`` is set (or :meth:`stop` is called)."""
        stop = stop or self._stop
        if self.wakeup is not None:
            self.wakeup.start()
        try:
            while not stop.is_set():
                full = self._pass()
                if not full:
                    self._sleep(stop)
        finally:
            if self.wakeup is not None:
                self.wakeup.stop()

    def _pass(self) -> bool:
        """One pass that survives database and broker trouble; True if the batch was full."""
        try:
            outcome = self.run_once()
        except exc.SQLAlchemyError as error:
            self.stats.errors += 1
            log.warning(
                "relay pass failed, retrying after the poll interval: %s", _first_line(error)
            )
            return False
        return outcome.claimed >= self.config.batch_size

    def _sleep(self, stop: threading.Event) -> None:
        if self.wakeup is None:
            stop.wait(self.config.poll_interval)
        else:
            self.wakeup.wait(self.config.poll_interval, stop)

    def start(self) -> threading.Thread:
        """Run in a background thread of this process (the in-application form)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="saga-engine-relay", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float | None = 10.0) -> None:
        """Finish the batch in hand and stop the background thread."""
        self._stop.set()
        if self.wakeup is not None:
            self.wakeup.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


def to_outgoing(row: sa.Row[Any]) -> OutgoingMessage:
    """The wire message for an outbox row: the envelope as JSON, keyed by partition key."""
    fields = {
        "message_id": row.message_id,
        "message_type": row.message_type,
        "destination": row.destination,
        "partition_key": row.partition_key,
        "aggregate_type": row.aggregate_type,
        "aggregate_id": row.aggregate_id,
        "correlation_id": row.correlation_id,
        "causation_id": row.causation_id,
        "tenant_id": row.tenant_id,
        "created_at": row.created_at.isoformat(),
        "headers": json.loads(row.headers) if row.headers != "{}" else {},
    }
    return OutgoingMessage(
        message_id=row.message_id,
        destination=row.destination,
        partition_key=row.partition_key,
        value=wire_bytes(fields, row.payload),
    )


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
