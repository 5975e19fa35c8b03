"""The message relay: claims outbox rows in batches, publishes them, settles the results.

One pass (:meth:`Relay.run_once`) is: claim up to ``batch_size`` rows (see ``claim``), publish them
(one broker round trip per message of its busiest key: see ``_publish_in_key_order``), settle every
acknowledged row (move them all to ``outbox_history`` with one statement, ``on_sent="archive"``,
the default on PostgreSQL; or mark them SENT with one UPDATE, ``"mark"``, the default elsewhere;
or delete them with one DELETE, ``"delete"``), and give each failed row ``retry_count + 1`` and
an exponential, jittered ``next_retry_at`` (FAILED past ``max_retries``). Nothing is settled before
the broker acknowledged it, so a relay killed at any point loses nothing: whatever it had in flight
is published again and the consumers' inbox absorbs the duplicate.

The loop (:meth:`Relay.run`) repeats at once while batches come back full, and otherwise sleeps
until a NOTIFY wake-up (PostgreSQL), the next poll, or a stop request, whichever comes first. Polls
are at a fixed rate: a poll whose passes took 0.2 s of a 0.5 s interval is followed by 0.3 s of
sleep, so a message committed just after a claim waits at most one interval plus one pass. A pass
the poll timer started claims only ``first_poll_batch`` rows (100), the oldest, and each full
claim after it twice as many, up to ``batch_size``: the rows that waited longest are
acknowledged first and soonest, not with the whole interval's backlog. Of several relays
on one PostgreSQL outbox, the one whose listener leads runs the passes that wake-ups start; the
others pass on their poll timer, and keep passing while batches come back full (``notify``).
Under load the leading relay mutes the writers' NOTIFYs and passes on its own timer (a standalone
relay: one pass straight after another) until a pass finds nothing (``pacing``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import random
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Connection, Engine, exc

from saga_engine import clock, db, errors, schema
from saga_engine.outbox import claim as claims
from saga_engine.outbox import cleanup
from saga_engine.outbox.claim import OutboxRow
from saga_engine.outbox.notify import Wakeup, listen_conninfo
from saga_engine.outbox.pacing import CoalescingWakeup
from saga_engine.transport.base import OutgoingMessage, PublishResult, Transport

log = logging.getLogger(__name__)
t = schema.outbox

#: ``RelayConfig.on_sent``: archive on PostgreSQL, else mark (``auto``); keep acknowledged rows as
#: SENT, move them to ``outbox_history``, or delete them.
ON_SENT = ("auto", "mark", "archive", "delete")


@dataclasses.dataclass(frozen=True)
class RelayConfig:
    """Relay tuning. ``batch_size`` ≈ peak rate * poll interval / relays (docs/outbox.md)."""

    batch_size: int = 500
    poll_interval: float = 0.5
    ack_timeout: float = 5.0
    max_retries: int = 10
    backoff_base: float = 1.0
    backoff_cap: float = 300.0
    jitter: float = 0.2
    claim: str = "auto"
    lease_seconds: float = 30.0
    outage_backoff_cap: float = 5.0
    pool_size: int = 2
    #: What becomes of an acknowledged row: ``"mark"`` keeps it, SENT, until cleanup deletes it
    #: after the retention; ``"archive"`` moves it, SENT, to ``outbox_history`` at once, which
    #: costs the database half as much and keeps the outbox to undelivered rows; ``"delete"``
    #: deletes it at once (the article's "or delete the record directly"), which costs a sixth
    #: as much and keeps no history. ``"auto"`` archives on PostgreSQL and marks elsewhere
    #: (``on_sent_for`` says why; docs/outbox.md).
    on_sent: str = "auto"
    #: Rows the first claim of a poll takes (a pass the poll timer started, or the relay's
    #: first); each full claim after it takes twice as many, up to ``batch_size``. A poll finds
    #: rows that have waited up to an interval, the oldest longest: in one claim of
    #: ``batch_size`` they would all wait for the whole batch's acknowledgement (docs/outbox.md,
    #: "Tuning").
    first_poll_batch: int = 100

    def __post_init__(self) -> None:
        if min(self.batch_size, self.first_poll_batch) < 1:
            raise ValueError("batch_size and first_poll_batch must be at least 1")
        if self.poll_interval <= 0 or self.ack_timeout <= 0:
            raise ValueError("poll_interval and ack_timeout must be positive")
        if self.max_retries < 1:
            raise ValueError("max_retries must be at least 1")
        if self.on_sent not in ON_SENT:
            raise ValueError(
                f"unknown on_sent {self.on_sent!r}: expected one of {', '.join(ON_SENT)}"
            )

    def backoff(self, retry_count: int, rng: random.Random) -> float:
        """Seconds before attempt ``retry_count + 1``: min(cap, base·2^retry), ±jitter."""
        # The exponent is capped: every sane cap is reached long before 2^64, and a float
        # overflows past 2^1023 (max_retries may be set very high).
        delay = min(self.backoff_cap, self.backoff_base * 2.0 ** min(retry_count, 64))
        return delay * (1 + self.jitter * (2 * rng.random() - 1))


@dataclasses.dataclass
class RelayStats:
    """Counters since the relay started (monitoring signal: relay rate, failure rate)."""

    batches: int = 0
    published: int = 0
    retried: int = 0
    failed: int = 0
    errors: int = 0
    #: Wake-ups left to the relay that leads (see ``notify``): no pass ran for them here. A
    #: follower does not listen, so these came from its own process (a worker's commits).
    wakeups_left_to_leader: int = 0


@dataclasses.dataclass(frozen=True)
class BatchOutcome:
    published: int
    retried: int
    failed: int
    claimed: int


class Relay:
    """Moves outbox rows to a transport. Safe to run as many at once as you like; on PostgreSQL
    the one whose listener leads runs the passes that wake-ups start (``notify``)."""

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
        self._outage_streak = 0  # consecutive batches of which nothing was acknowledged
        self.strategy = claims.strategy_for(
            engine, self.config.claim, timedelta(seconds=self.config.lease_seconds)
        )
        #: ``config.on_sent`` with ``"auto"`` decided for this database.
        self.on_sent = on_sent_for(engine, self.config.on_sent)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_database(
        cls,
        db_url: str,
        transport: Transport,
        config: RelayConfig | None = None,
        *,
        wake_interval: float = 0.0,
        **kwargs: Any,
    ) -> Relay:
        """A relay with its own small connection pool, apart from the application's (pit 3).

        ``wake_interval``: the least time between the starts of two passes that wake-ups start
        (``relay_wakeup``); a worker's relays wait ``relay_wake_interval``.
        """
        config = config or RelayConfig()
        engine = relay_engine(db_url, config.pool_size)
        wakeup = kwargs.pop("wakeup", None) or relay_wakeup(engine, wake_interval)
        return cls(engine, transport, config, wakeup=wakeup, **kwargs)

    # -- one pass ---------------------------------------------------------------------------

    def run_once(self, limit: int | None = None) -> BatchOutcome:
        """Claim (up to ``limit`` rows, ``batch_size`` by default), publish and mark one batch."""
        now = self.clock.now()
        with self.strategy.claim(self.engine, limit or self.config.batch_size, now) as batch:
            if not batch.rows:
                return BatchOutcome(0, 0, 0, 0)
            results, unsent = self._publish_in_key_order(batch.rows)
            outcome = self._mark(batch, results)
            if unsent and batch.token is not None:
                # Not attempted: hand the lease back now rather than make them wait it out.
                claims.release(batch.conn, [row.id for row in unsent], batch.token)
        self._count(outcome)
        return outcome

    def _publish_in_key_order(
        self, rows: Sequence[OutboxRow]
    ) -> tuple[list[PublishResult], list[OutboxRow]]:
        """Publish ``rows`` in waves, wave i holding the i-th row of each key; returns the results
        and the rows left unattempted.

        Sent in one call, a transport that fails message 1 of a key may still deliver message 2
        (results are per message), and 2 would overtake 1. So a row goes out only after the
        previous row of its key was acknowledged, and a key whose row failed drops out of the
        batch: its later rows stay PENDING behind it, where the order guard keeps them. A batch of
        distinct keys is still one round trip, and so is any batch for a transport whose
        ``atomic_publish`` says it acknowledges a whole call or none of it.
        """
        if self.transport.atomic_publish:
            return self._publish(rows), []
        queues: dict[str, list[OutboxRow]] = {}
        for row in rows:
            queue = queues.get(row.partition_key)
            if queue is None:
                queues[row.partition_key] = [row]
            else:
                queue.append(row)
        if len(queues) == len(rows):  # one row per key: a single wave, the rows as they are
            return self._publish(rows), []
        results: list[PublishResult] = []
        unsent: list[OutboxRow] = []
        live = list(queues.values())
        depth = 0
        while live:
            wave = [queue[depth] for queue in live]
            wave_results = self._publish(wave)
            results += wave_results
            depth += 1
            kept = []
            for queue, result in zip(live, wave_results, strict=True):
                if not result.ok:
                    unsent += queue[depth:]
                elif len(queue) > depth:
                    kept.append(queue)
            live = kept
        return results, unsent

    def _publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        """One result per row, in row order, whatever the transport does."""
        messages = [to_outgoing(row) for row in rows]
        try:
            results = self.transport.publish(messages, self.config.ack_timeout)
        except Exception as error:  # the port says publish never raises; a broken adapter that
            # does must still not stop the relay, and must cost its rows an attempt (no hot loop).
            log.exception("transport %s raised instead of reporting", self.transport.name)
            reason = f"transport raised {type(error).__name__}: {error}"
            return [PublishResult(m.message_id, reason) for m in messages]
        by_id = {r.message_id: r for r in results}
        missing = "the transport returned no result for this message"
        return [by_id.get(m.message_id) or PublishResult(m.message_id, missing) for m in messages]

    def _mark(self, batch: claims.Claim, results: Sequence[PublishResult]) -> BatchOutcome:
        now = self.clock.now()
        by_id = {row.message_id: row for row in batch.rows}
        sent = [by_id[r.message_id].id for r in results if r.ok]
        failures = [(by_id[r.message_id], r) for r in results if not r.ok]
        self._outage_streak = self._outage_streak + 1 if failures and not sent else 0
        owned = batch.token is not None
        if owned:
            # A leased batch is marked in a transaction of its own, so it takes its locks in the
            # same order as the claims do (see ``claims.lock_in_id_order``).
            claims.lock_in_id_order(batch.conn, [row.id for row in batch.rows])
        statements = mark_statements(batch.conn, owned=owned)
        marked = 0
        if sent:
            params = {"ids": sent, "now": now, "token": batch.token}
            marked = statements.settle(batch.conn, self.on_sent, params)
            if marked < len(sent):
                # Our lease ran out mid-publish and another relay owns them: it will send again.
                log.warning("%d published rows were no longer ours to mark", len(sent) - marked)
        retried = failed = 0
        if failures:
            rows = [self._failure_values(row, result, now, batch.token) for row, result in failures]
            failed = sum(1 for r in rows if r["new_status"] == schema.OutboxStatus.FAILED)
            retried = len(rows) - failed
            batch.conn.execute(statements.failed, rows)
        return BatchOutcome(marked, retried, failed, len(batch.rows))

    def _failure_values(
        self, row: OutboxRow, result: PublishResult, now: datetime, token: str | None
    ) -> dict[str, Any]:
        error = result.error or "unknown"
        if result.unreachable:
            # An outage is nobody's message's fault: wait (growing with the outage) but keep the
            # retry budget, so a broker down for hours delays messages and never fails them.
            retry_count, exhausted = row.retry_count, False
            outage = self.config.backoff(min(self._outage_streak, 16), self.rng)
            # Probing a dead broker costs one claim, so keep the wait short: once the broker is
            # back, the backlog goes within seconds, not after a long exponential wait.
            delay = min(outage, self.config.outage_backoff_cap)
        else:
            retry_count = row.retry_count + 1
            exhausted = retry_count >= self.config.max_retries
            delay = self.config.backoff(row.retry_count, self.rng)
        log.warning(
            "outbox message %s to %s failed (%s): %s",
            row.message_id,
            row.destination,
            "broker unreachable" if result.unreachable else f"attempt {retry_count}",
            error,
        )
        return {
            "row_id": row.id,
            "new_status": schema.OutboxStatus.FAILED if exhausted else schema.OutboxStatus.PENDING,
            "new_retry_count": retry_count,
            "new_next_retry_at": now + timedelta(seconds=delay),
            "new_last_error": error[:2000],
            "new_updated_at": now,
            "token": token,
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
            limit = self._poll_limit()
            while not stop.is_set():
                began = time.monotonic()
                result = self._poll(limit, stop)
                # Fixed rate from the poll's first pass, so a backlog does not stretch the
                # interval. After a failure, wait the whole interval: a database that fails fast
                # must not be retried in a hot loop.
                took = time.monotonic() - began if result is PassResult.PARTIAL else 0.0
                seconds = fixed_rate_sleep(self.config.poll_interval, took)
                next_poll = time.monotonic() + seconds
                while (woken := self._sleep(stop, seconds)) and self._follows():
                    self.stats.wakeups_left_to_leader += 1
                    seconds = max(0.0, next_poll - time.monotonic())
                # A wake-up's rows are new; the poll timer's have waited up to an interval.
                limit = self.config.batch_size if woken else self._poll_limit()
        finally:
            if self.wakeup is not None:
                self.wakeup.stop()

    def _poll(self, limit: int, stop: threading.Event) -> PassResult:
        """Passes until one claims fewer rows than it asked for, fails, or ``stop`` is set; each
        full claim is followed at once by one of twice the rows, up to ``batch_size``."""
        result = self._pass(limit)
        while result is PassResult.FULL and not stop.is_set():
            limit = min(2 * limit, self.config.batch_size)
            result = self._pass(limit)
        return result

    def _poll_limit(self) -> int:
        """The first claim of a poll: a few of the oldest rows (``first_poll_batch``)."""
        return min(self.config.first_poll_batch, self.config.batch_size)

    def _pass(self, limit: int | None = None) -> PassResult:
        """One pass that survives database and broker trouble; FULL if it claimed ``limit``."""
        limit = limit or self.config.batch_size
        try:
            outcome = self.run_once(limit)
        except exc.SQLAlchemyError as error:
            self.stats.errors += 1
            log.warning(
                "relay pass failed, retrying after the poll interval: %s", _first_line(error)
            )
            self._after_pass(None)
            return PassResult.FAILED
        self._after_pass(outcome.claimed)
        return PassResult.FULL if outcome.claimed >= limit else PassResult.PARTIAL

    def _after_pass(self, claimed: int | None) -> None:
        if self.wakeup is not None:
            self.wakeup.after_pass(claimed)

    def _sleep(self, stop: threading.Event, seconds: float) -> bool:
        """Sleep until the next poll, a wake-up or ``stop``; True if a wake-up ended it."""
        if self.wakeup is None:
            stop.wait(seconds)
            return False
        return self.wakeup.wait(seconds, stop)

    def _follows(self) -> bool:
        """Another relay's listener leads: it got the same wake-up and passes for it."""
        return self.wakeup is not None and self.wakeup.follower

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


#: Run by every connection of a relay's own pool on PostgreSQL (see :func:`relay_engine`).
PLAN_EACH_EXECUTION = "SET plan_cache_mode = force_custom_plan"
#: The same: the relay's statements read its indexes in index order, never through a bitmap.
NO_BITMAP_SCANS = "SET enable_bitmapscan = off"
#: The same: its commits do not wait for the WAL to reach the disk (see :func:`relay_engine`).
ASYNC_COMMITS = "SET synchronous_commit = off"


#: The lead among the listening relays of one outbox (``notify``): a session-level advisory lock
#: keyed by the outbox table's oid, so the outboxes of two schemas or databases have leads of their
#: own. The first key keeps it apart from the application's advisory locks. NULL, neither lead nor
#: follow, while the table does not exist.
LEAD_LOCK_SPACE = 0x5A6A
LEAD = f"SELECT pg_try_advisory_lock({LEAD_LOCK_SPACE}, {schema.OUTBOX_LOCK_KEY})"


def relay_wakeup(engine: Engine, min_interval: float = 0.0) -> CoalescingWakeup:
    """A relay's wake-up: NOTIFY on PostgreSQL, where its listener also tries for the lead.

    With no ``min_interval`` (a standalone relay: delivering is all it does), each wake-up starts
    a pass at once. Under load, when NOTIFYs come while its passes run, the leading relay mutes
    them and passes straight after one another instead (``pacing``): the passes follow one
    another either way, and the writers' commits no longer each take PostgreSQL's NOTIFY lock and
    wake the listener. A worker's relays wait ``relay_wake_interval`` between passes.
    """
    return CoalescingWakeup(listen_conninfo(engine), lead=LEAD, min_interval=min_interval)


def relay_engine(db_url: str, pool_size: int) -> Engine:
    """The relay's own small pool, apart from the application's (pit 3).

    On PostgreSQL its sessions plan every statement for the parameters and the table of the
    moment. The outbox is a queue: it may be empty, and analyzed as empty, one minute and hold a
    backlog the next. psycopg prepares a statement on its fifth execution, and a generic plan
    made while the table looked empty (a sequential scan) then served every pass until the next
    ANALYZE, however large the table grew. At 1,000 messages/s a pass's mark took 2.9-4.0 ms
    instead of 0.6-0.9. Planning a pass's three statements anew costs less than one such scan.
    The order guard then skips its ``SET LOCAL`` for large claims, which relays built as
    ``Relay(engine, ...)`` on any other engine still need.

    Its sessions also use no bitmap scans. Every marked or deleted row leaves a dead entry in the
    indexes of PENDING rows until VACUUM removes it. A plain index scan visits such an entry once
    and flags it dead, and later scans skip it; a bitmap scan never flags one, so it visits every
    entry no plain scan flagged, on every claim. With statistics from a quiet moment the planner
    chose bitmap scans for the claim, and after 100,000 rows were marked a claim of one row took
    25 ms instead of 1.1.

    And its sessions commit without waiting for the WAL to reach the disk
    (``synchronous_commit = off``). What a relay commits is only the news that messages were
    delivered: their marks, archive moves, retry counts. If the server crashes before such a
    commit is on disk (at most three ``wal_writer_delay``, 0.6 s by default), the rows are
    PENDING again after recovery and go out once more, which consumers already expect (their
    inbox drops the copy), as after a relay killed between the broker's acknowledgement and its
    commit. Nothing can be lost: a crash loses only the newest commits, in WAL order, so a key's
    earlier messages never stay marked while a later one is sent again. The acknowledgement that
    matters is the broker's (``acks=all``; the ``sql://`` transport commits through an engine of
    its own, which waits). So do not hand an engine made here to a transport. Business
    transactions, the writers' and the consumers', keep waiting for the disk. A pass no longer
    waits for a flush: on the development machine a one-row pass spent 0.64-0.69 ms outside its
    statements and its publish, against 0.85-1.55 before (``bench pass``, alternated); a disk
    with slower flushes gains more.
    """
    engine = db.create_engine(db_url, pool_size=pool_size)
    if engine.dialect.name == "postgresql":
        sa.event.listen(engine, "connect", _relay_session)
    return engine


def _relay_session(dbapi_connection: Any, record: Any) -> None:
    with dbapi_connection.cursor() as cursor:
        cursor.execute(PLAN_EACH_EXECUTION)
        cursor.execute(NO_BITMAP_SCANS)
        cursor.execute(ASYNC_COMMITS)
    dbapi_connection.commit()  # session settings, kept past the pool's rollback on return
    record.info[claims.PLANS_EACH_EXECUTION] = True


def to_outgoing(row: OutboxRow | sa.Row[*tuple[Any, ...]]) -> OutgoingMessage:
    """The wire message for an outbox row: the envelope as JSON, keyed by partition key.

    The bytes are those of ``messages.wire_bytes`` (a test holds them equal), written out here
    field by field: the relay builds thousands a second, and a generic encoder's dispatch over a
    dict of ten fields cost more than the rest of the message. The stored headers and payload are
    JSON already and are spliced in as they are.
    """
    (
        _,
        message_id,
        message_type,
        destination,
        partition_key,
        aggregate_type,
        aggregate_id,
        correlation_id,
        causation_id,
        tenant_id,
        headers,
        payload,
        _,
        created_at,
    ) = claims.outbox_row(row)
    value = (
        f'{{"message_id":{_json(message_id)},"message_type":{_json(message_type)},'
        f'"destination":{_json(destination)},"partition_key":{_json(partition_key)},'
        f'"aggregate_type":{_json(aggregate_type)},"aggregate_id":{_json(aggregate_id)},'
        f'"correlation_id":{_json(correlation_id)},"causation_id":{_json(causation_id)},'
        f'"tenant_id":{_json(tenant_id)},"created_at":"{_utc_iso(created_at)}",'
        f'"headers":{headers},"payload":{payload}}}'
    ).encode()
    return OutgoingMessage(message_id, destination, partition_key, value)


#: The envelope's own encoder settings (``messages.wire_bytes``), for values that are not text.
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=str)
#: The C function that encoder uses for every string (it escapes to ASCII).
_quote = json.encoder.encode_basestring_ascii


def _json(value: object) -> str:
    if type(value) is str:
        return _quote(value)
    # None is most ids of most rows, and the encoder takes ten times as long to say "null".
    return "null" if value is None else _ENCODER.encode(value)


def _utc_iso(stored: datetime) -> str:
    # Stored naive (UTC by convention, see ``clock``); on the wire say so, or a consumer in
    # another time zone or language would read it as local time.
    if stored.tzinfo is None:
        return stored.isoformat() + "+00:00"  # what .replace(tzinfo=UTC).isoformat() gives
    return stored.replace(tzinfo=UTC).isoformat()


class PassResult(enum.Enum):
    """How a pass of :meth:`Relay.run` ended, which decides how long the loop sleeps."""

    FULL = "full"  # the batch was full: more is waiting, go again at once
    PARTIAL = "partial"
    FAILED = "failed"


def fixed_rate_sleep(poll_interval: float, poll_seconds: float) -> float:
    """How long to sleep after a poll whose passes took ``poll_seconds``: the rest of the interval.

    Sleeping a whole interval after each poll would let a message committed just after a claim
    wait the rest of that poll, the interval and the next pass; a fixed rate removes the first.
    Counted from the poll's first pass, not its last, so a backlog does not stretch the interval.
    """
    return max(0.0, poll_interval - poll_seconds)


@dataclasses.dataclass(frozen=True)
class MarkStatements:
    """A batch's marks, built once: ``sent`` or ``deleted`` (parameters ``ids``, ``now``,
    ``token``) and ``failed`` (executemany of ``_failure_values``). With a token they touch only
    rows the lease still covers: a leased row whose lease ran out may belong to another relay by
    now."""

    sent: sa.Update
    deleted: sa.Executable
    #: Run in this order: the last one's rowcount is the number of rows archived.
    archived: tuple[sa.Executable, ...]
    failed: sa.Update
    #: ``deleted`` takes one row (``id``) per execution (MySQL and MariaDB: see
    #: ``claims.delete_rows``).
    delete_per_row: bool = False

    def done(self, on_sent: str) -> tuple[sa.Executable, ...]:
        """The statements that settle acknowledged rows as ``on_sent`` says."""
        if on_sent == "archive":
            return self.archived
        return (self.deleted,) if on_sent == "delete" else (self.sent,)

    def settle(self, conn: Connection, on_sent: str, params: dict[str, Any]) -> int:
        """Settle the acknowledged rows ``params["ids"]`` as ``on_sent`` says; how many were."""
        settled = 0
        for statement in self.done(on_sent):
            if statement is self.deleted and self.delete_per_row:
                settled = claims.delete_rows(conn, params["ids"], params["token"])
            else:
                settled = conn.execute(statement, params).rowcount
        return settled

    @classmethod
    def build(cls, *, server: str, owned: bool) -> MarkStatements:
        """The marks for ``server`` (one of ``SERVERS``), of a leased (``owned``) batch or not."""
        array = server == "postgresql"
        now = sa.bindparam("now", type_=t.c.sent_at.type)
        ids = db.in_list(t.c.id, "ids", array=array)
        acknowledged = [ids]
        failed = sa.update(t).where(t.c.id == sa.bindparam("row_id"))
        if owned:
            mine = t.c.claimed_by == sa.bindparam("token", type_=t.c.claimed_by.type)
            acknowledged.append(mine)
            failed = failed.where(mine)
        sent = claims.update_by_primary_key(sa.update(t).where(*acknowledged))
        deleted = _delete(acknowledged, server=server, owned=owned)
        released = {"claimed_by": sa.null(), "lease_until": sa.null()}
        return cls(
            sent=sent.values(
                status=claims.status_literal(schema.OutboxStatus.SENT),
                sent_at=now,
                updated_at=now,
                **released,
            ),
            # A DELETE only stamps each row dead: no new row version, and no new entry in each of
            # the table's full indexes (7.8 -> 0.9 us of server CPU per message).
            deleted=deleted,
            archived=_archive(acknowledged, deleted, now, array=array),
            delete_per_row=server == "mysql",
            failed=failed.values(
                status=sa.bindparam("new_status"),
                retry_count=sa.bindparam("new_retry_count"),
                next_retry_at=sa.bindparam("new_next_retry_at"),
                last_error=sa.bindparam("new_last_error"),
                updated_at=sa.bindparam("new_updated_at"),
                **released,
            ),
        )


def _delete(
    acknowledged: Sequence[sa.ColumnElement[bool]], *, server: str, owned: bool
) -> sa.Executable:
    """The ``DELETE`` of the acknowledged rows; on MySQL and MariaDB one row at a time, by
    primary key (``claims.delete_rows`` says why)."""
    if server == "mysql":
        return claims.delete_by_primary_key(owned=owned)
    return sa.delete(t).where(*acknowledged)


def _archive(
    acknowledged: Sequence[sa.ColumnElement[bool]],
    delete: sa.Executable,
    now: sa.BindParameter[Any],
    *,
    array: bool,
) -> tuple[sa.Executable, ...]:
    """Move the ``acknowledged`` rows to ``outbox_history``, stamped SENT at ``now``.

    A move writes less than a mark: the DELETE only stamps the row dead, and the history takes one
    new row with one index entry, where the mark's UPDATE writes a new row version and an entry in
    each of the outbox's full indexes (on PostgreSQL the primary key and the message id's; a
    500-row batch: 2.7 ms against 5.6 when a third index held SENT rows).
    On PostgreSQL one statement (a ``DELETE ... RETURNING`` feeding the ``INSERT``); elsewhere the
    INSERT ... SELECT comes first and reads through the primary key, in id order, like the locks
    every claim and mark takes (see ``claims.by_primary_key``), and then ``delete`` runs.
    """
    history = schema.outbox_history
    stamped = {
        "status": claims.status_literal(schema.OutboxStatus.SENT),
        "sent_at": now,
        "updated_at": now,
    }
    if array:
        returned = [t.c[name] for name in schema.ARCHIVED_COLUMNS]
        moved = sa.delete(t).where(*acknowledged).returning(*returned).cte("moved")
        rows = cleanup.history_rows(moved, now, stamped)
        # SQLAlchemy keeps an INSERT's rowcount only when asked: it is the number archived.
        insert = history.insert().from_select(cleanup.HISTORY_COLUMNS, rows)
        return (insert.execution_options(preserve_rowcount=True),)
    rows = claims.by_primary_key(cleanup.history_rows(t, now, stamped).where(*acknowledged))
    return history.insert().from_select(cleanup.HISTORY_COLUMNS, rows), delete


def on_sent_for(engine: Engine, on_sent: str) -> str:
    """``on_sent`` for relays on ``engine``: ``"auto"`` becomes ``"archive"`` on PostgreSQL and
    ``"mark"`` elsewhere; an explicit ``"archive"`` where it cannot work is refused.

    Not ``"archive"`` on MySQL and MariaDB, which could: there a DELETE of a batch's ids deadlocked
    between relays (``claims.delete_rows``), so it deletes one row per statement, and the move
    then costs more than the mark's single UPDATE. On MariaDB two relays archiving delivered 0.179
    times the raw producer's rate, against 0.432 marking (``bench relay``, 30,000 messages).
    """
    if on_sent == "auto":
        return "archive" if engine.dialect.name == "postgresql" else "mark"
    if on_sent == "archive":
        refusal = archive_refusal(engine)
        if refusal is not None:
            raise errors.ConfigurationError(refusal)
    return on_sent


def archive_refusal(engine: Engine) -> str | None:
    """Why ``on_sent="archive"`` cannot work on ``engine``'s database, or None where it can.

    ``outbox_history`` is keyed by the outbox's ids, and archiving empties the outbox. SQLite then
    gives the next row the id 1 again, as does MySQL before 8.0 after a restart: the archive of
    that row would collide with the earlier one.
    """
    dialect = engine.dialect
    if dialect.name == "sqlite":
        return (
            'on_sent="archive" needs ids that are never handed out again: SQLite reuses them '
            'once the table is empty; use "mark" or "delete" there'
        )
    mysql = dialect.name == "mysql" and not getattr(dialect, "is_mariadb", False)
    if mysql and db.server_version(engine) < (8, 0):
        return (
            'on_sent="archive" needs MySQL 8.0 or later: earlier servers forget the next '
            'id on restart and hand out ids of archived rows again; use "mark" or "delete"'
        )
    return None


#: The kinds of server whose marks differ: PostgreSQL binds lists as arrays, MySQL and MariaDB
#: delete through the primary key, and the rest (SQLite) take the plain statements.
SERVERS = ("postgresql", "mysql", "other")

#: By (kind of server, leased batch).
_MARKS = {
    (server, owned): MarkStatements.build(server=server, owned=owned)
    for server in SERVERS
    for owned in (False, True)
}


def mark_statements(conn: Connection, *, owned: bool) -> MarkStatements:
    """The marks for ``conn``'s kind of server, for a leased (``owned``) or a locked batch."""
    return _MARKS[_server(conn), owned]


def _server(conn: Connection) -> str:
    if db.uses_arrays(conn.dialect):
        return "postgresql"
    return "mysql" if db.dialect_name(conn) == "mysql" else "other"


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
