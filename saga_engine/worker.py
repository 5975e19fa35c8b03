"""The worker: runs everything an app declares, each role in its own thread.

Roles: ``orchestrator`` (applies replies), ``participants`` (runs command handlers), ``relay`` (one
per database that has an outbox), ``deadlines`` (timeouts and back-offs), ``cleanup`` (old SENT
rows, old inbox entries; ended sagas and old dead letters when given a retention). Any number of
workers can run at once: consumers share channels through consumer groups (Kafka) or row leases
(SQL transport), relays through SKIP LOCKED or leases, deadlines through the instances' version
check. A stop request lets every loop finish the batch in hand.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta

from sqlalchemy import Engine, exc

from saga_engine import db, deadletter, errors, inbox, store, transport
from saga_engine.app import App
from saga_engine.consumer import BatchScope, DedupeKey, MessageConsumer, by_message_id
from saga_engine.outbox import cleanup
from saga_engine.outbox.pacing import RELAY_WAKE_INTERVAL
from saga_engine.outbox.relay import Relay
from saga_engine.transport.base import Transport

log = logging.getLogger(__name__)

ROLES = ("orchestrator", "participants", "relay", "deadlines", "cleanup")


@dataclasses.dataclass
class WorkerOptions:
    db_url: str
    broker_url: str = "sql://"
    roles: Sequence[str] = ROLES
    participants: Sequence[str] | None = None  # None: all of the app's
    participant_dbs: dict[str, str] = dataclasses.field(default_factory=dict)
    deadline_interval: float = 0.2
    cleanup_interval: float = 3600.0
    retention: timedelta = cleanup.RETENTION
    #: Inbox entries older than this are pruned by the cleanup role; None keeps them all.
    inbox_retention: timedelta | None = inbox.INBOX_RETENTION
    #: Sagas that ended longer ago than this are deleted by the cleanup role; None (the default)
    #: keeps them: they may be business records.
    saga_retention: timedelta | None = None
    #: Dead letters older than this are deleted by the cleanup role; None (the default) keeps
    #: them until an operator deletes them.
    dead_letter_retention: timedelta | None = None
    #: Rows in ``outbox_history`` (archived by the relays, as ``RelayConfig.on_sent`` does by
    #: default on PostgreSQL, or by cleanup's archive) archived longer ago than this are
    #: deleted by the cleanup role; None keeps them.
    history_retention: timedelta | None = cleanup.HISTORY_RETENTION
    relay_wake_interval: float = RELAY_WAKE_INTERVAL

    def __post_init__(self) -> None:
        if self.retention < timedelta(0):
            raise errors.ConfigurationError("retention must not be negative")
        retentions = (
            "inbox_retention",
            "saga_retention",
            "dead_letter_retention",
            "history_retention",
        )
        for name in retentions:
            value = getattr(self, name)
            if value is not None and value <= timedelta(0):
                raise errors.ConfigurationError(f"{name} must be positive, or None to keep all")
        unknown = set(self.roles) - set(ROLES)
        if unknown:
            raise errors.ConfigurationError(
                f"unknown role(s) {', '.join(sorted(unknown))}: choose from {', '.join(ROLES)}"
            )


class Worker:
    def __init__(self, app: App, options: WorkerOptions) -> None:
        self.app = app
        self.options = options
        names = options.participants if options.participants is not None else list(app.participants)
        for name in names:
            if name not in app.participants:
                raise errors.ConfigurationError(f"app {app.name!r} has no participant {name!r}")
        self.participant_names = list(names)
        self.engines: dict[str, Engine] = {}
        self.stop_event = threading.Event()
        self.crashed = False
        self.threads: list[threading.Thread] = []
        self.consumers: list[MessageConsumer] = []
        self.relays_by_db: dict[str, list[Relay]] = {}
        self.main_engine = self.engine(options.db_url)
        self.transport: Transport = transport.from_url(options.broker_url, engine=self.main_engine)

    @property
    def relays(self) -> list[Relay]:
        """Every relay of this worker, of all its databases."""
        return [relay for relays in self.relays_by_db.values() for relay in relays]

    def engine(self, url: str) -> Engine:
        if url not in self.engines:
            # One connection per thread that may use this engine at once (consumers, deadlines,
            # the SQL transport's claims); a smaller pool reconnects on every overflow.
            engine = db.create_engine(url, pool_size=len(self.app.participants) + 4)
            db.check_connection(engine)
            self.engines[url] = engine
        return self.engines[url]

    def participant_db(self, name: str) -> str:
        return self.options.participant_dbs.get(name, self.options.db_url)

    # -- building the loops ---------------------------------------------------------------------

    def build(self) -> None:
        roles = set(self.options.roles)
        self.transport.ensure_channels(self.app.channels)
        if "orchestrator" in roles and self.app.sagas:
            self._consumer(
                "orchestrator",
                self.options.db_url,
                self.app.reply_channels,
                self.app.orchestrator.on_reply,
                self.app.orchestrator.give_up,
                batch=self.app.orchestrator.batch,
            )
        if "participants" in roles:
            for name in self.participant_names:
                service = self.app.participant_service(name)
                self._consumer(
                    service.consumer_name,
                    self.participant_db(name),
                    [service.participant.channel],
                    service.handle,
                    service.give_up,
                    dedupe_key=service.dedupe_key,
                    batch=service.batch,
                )
        if "relay" in roles:
            urls = {self.options.db_url, *(self.participant_db(n) for n in self.participant_names)}
            for url in sorted(urls):
                relay = Relay.for_database(
                    url,
                    self.transport,
                    self.app.relay_config,
                    wake_interval=self.options.relay_wake_interval,
                    clock=self.app.clock,
                )
                self.relays_by_db.setdefault(url, []).append(relay)
                self._thread(f"relay {db.redact(url)}", relay.run)
        if "deadlines" in roles and self.app.sagas:
            self._thread("deadlines", self._deadlines)
        if "cleanup" in roles:
            self._thread("cleanup", self._cleanup)

    def _consumer(
        self,
        name: str,
        db_url: str,
        channels: list[str],
        handler: Callable[..., None],
        give_up: Callable[..., None],
        *,
        batch: BatchScope,
        dedupe_key: DedupeKey = by_message_id,
    ) -> None:
        consumer = MessageConsumer(
            name,
            self.engine(db_url),
            self.transport,
            channels,
            handler,
            give_up=give_up,
            config=self.app.consumer_config,
            clock=self.app.clock,
            on_commit=functools.partial(self.wake_relays, db_url),
            dedupe_key=dedupe_key,
            batch=batch,
        )
        self.consumers.append(consumer)
        self._thread(name, consumer.run)

    def wake_relays(self, db_url: str | None = None) -> None:
        """Wake the relays of ``db_url`` (all of them if None): a commit there added outbox rows.

        Only a flag is set; the relays' wake-up (``pacing.CoalescingWakeup``) decides when the pass
        runs.
        """
        relays = self.relays if db_url is None else self.relays_by_db.get(db_url, ())
        for relay in relays:
            if relay.wakeup is not None:
                relay.wakeup.notify()

    def _thread(self, name: str, target: Callable[[threading.Event], None]) -> None:
        def guarded() -> None:
            try:
                target(self.stop_event)
            except Exception:
                log.exception("%s stopped by an unexpected error; stopping the worker", name)
                self.crashed = True  # the process exits non-zero, so a supervisor restarts it
                self.stop_event.set()

        self.threads.append(threading.Thread(target=guarded, name=name, daemon=True))

    # -- periodic roles -------------------------------------------------------------------------

    def _deadlines(self, stop: threading.Event) -> None:
        while not stop.wait(self.options.deadline_interval):
            try:
                self.check_deadlines()
            except exc.SQLAlchemyError as error:
                log.warning("deadline check failed: %s", str(error).splitlines()[0])

    def check_deadlines(self, limit: int = 500) -> int:
        """Act on every passed deadline; returns how many sagas moved."""
        engine, orchestrator = self.main_engine, self.app.orchestrator
        with engine.connect() as conn:
            due = store.due(conn, self.app.clock.now(), limit)
        moved = 0
        for saga_id in due:
            try:
                with engine.begin() as conn:
                    moved += orchestrator.on_deadline(conn, saga_id)
            except errors.ConcurrentUpdate:
                continue  # another worker or a reply got there first; it will be re-read if due
            except exc.SQLAlchemyError:
                raise  # the database is away: the loop waits and tries again
            except Exception as error:
                # A local step's own bug: retrying it on every pass would never end (and would
                # stop the worker), so the saga goes to FAILED with the error for an operator.
                log.exception("deadline of saga %s failed", saga_id)
                with engine.begin() as conn:
                    orchestrator.fail(conn, saga_id, f"deadline action failed: {error!r}")
        return moved

    def _cleanup(self, stop: threading.Event) -> None:
        while not stop.wait(self.options.cleanup_interval):
            for engine in list(self.engines.values()):
                try:
                    self.clean(engine)
                except exc.SQLAlchemyError as error:
                    log.warning("cleanup failed: %s", str(error).splitlines()[0])

    def clean(self, engine: Engine) -> None:
        """One cleanup pass over one of the worker's databases: whatever each retention lets go."""
        options, clock = self.options, self.app.clock
        cleanup.cleanup(engine, retention=options.retention, clock=clock)
        if options.inbox_retention is not None:
            inbox.prune(engine, retention=options.inbox_retention, clock=clock)
        if options.dead_letter_retention is not None:
            deadletter.prune(engine, retention=options.dead_letter_retention, clock=clock)
        if options.history_retention is not None:
            cleanup.prune_history(engine, retention=options.history_retention, clock=clock)
        # Sagas live in the orchestrator's database only.
        if options.saga_retention is not None and engine is self.main_engine and self.app.sagas:
            store.prune_ended(engine, retention=options.saga_retention, clock=clock)

    # -- running --------------------------------------------------------------------------------

    def start(self) -> None:
        if not self.threads:
            self.build()
        for thread in self.threads:
            thread.start()

    def run(self, stop: threading.Event | None = None) -> None:
        """Run until ``stop`` (or :meth:`stop`) is set, then finish the batches in hand."""
        self.start()
        outer = stop or self.stop_event
        while not outer.wait(0.5) and not self.stop_event.is_set():
            pass
        self.stop()

    def stop(self, timeout: float = 30.0) -> None:
        self.stop_event.set()
        self.wake_relays()  # a relay waiting for its next poll sees the stop at once
        for thread in self.threads:
            if thread.is_alive():
                thread.join(timeout)
        self.transport.close()
        for engine in self.engines.values():
            engine.dispose()
        for relay in self.relays:
            relay.engine.dispose()
