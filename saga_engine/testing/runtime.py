"""A deterministic, single-threaded runtime of the real engine, for tests.

The same relay, consumers, inbox, orchestrator and participant code the worker runs, driven one
pass at a time by the test instead of by threads, against a real database (SQLite or a server) and
the SQL transport, with a :class:`ManualClock` instead of wall time. Nothing here is a model of
the engine: a test that passes here passed through the production code paths.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import Engine

from saga_engine import errors, store
from saga_engine.app import App
from saga_engine.consumer import ConsumerConfig, MessageConsumer
from saga_engine.outbox.relay import Relay, RelayConfig
from saga_engine.participant import ParticipantService
from saga_engine.transport.base import Transport
from saga_engine.transport.sql import SqlTransport

START = datetime(2030, 1, 1)


class ManualClock:
    """A clock that moves only when told to (naive UTC, like the engine's timestamps)."""

    def __init__(self, start: datetime = START) -> None:
        self.current = start

    def now(self) -> datetime:
        return self.current

    def advance(self, seconds: float) -> None:
        self.current += timedelta(seconds=seconds)


class Runtime:
    """Relay, orchestrator and participant consumers of ``app`` on one database, stepped by hand."""

    def __init__(
        self,
        app: App,
        engine: Engine,
        *,
        clock: ManualClock | None = None,
        transport: Transport | None = None,
        batch_size: int = 100,
        participant_engines: dict[str, Engine] | None = None,
        services: Callable[[str], ParticipantService] | None = None,
        relay_transport: Callable[[Transport], Transport] | None = None,
        seed: int = 0,
    ) -> None:
        self.app = app
        self.engine = engine
        self.clock = clock or ManualClock()
        if app.clock is not self.clock:
            raise errors.ConfigurationError("build the App with clock=<this runtime's clock>")
        self.transport = transport or SqlTransport(
            engine, clock=self.clock, idle_poll=0.0, listen=False
        )
        self.services = services or app.participant_service
        engines = {name: engine for name in app.participants} | (participant_engines or {})
        config = ConsumerConfig(
            batch_size=batch_size,
            poll_timeout=0.0,
            retry_delay=0.0,
            max_attempts=app.consumer_config.max_attempts,
        )
        self.consumers = [self._orchestrator(config)] + [
            self._participant(name, engines[name], config) for name in sorted(app.participants)
        ]
        # on_sent is "mark" whatever the app says: the "nothing lost" invariant checks each
        # outbox row against the inboxes, which needs the delivered rows kept in the outbox.
        relay_config = RelayConfig(
            on_sent="mark",
            batch_size=batch_size,
            claim=app.relay_config.claim,
            max_retries=app.relay_config.max_retries,
        )
        outgoing = relay_transport(self.transport) if relay_transport else self.transport
        # Seeded: the relays jitter their retry back-off, and a run stepped by hand must repeat
        # exactly (a property test replays a failing example and expects the same failure).
        self.relays = [
            Relay(e, outgoing, relay_config, clock=self.clock, rng=random.Random(seed + i))
            for i, e in enumerate({id(e): e for e in [engine, *engines.values()]}.values())
        ]

    def _orchestrator(self, config: ConsumerConfig) -> MessageConsumer:
        o = self.app.orchestrator
        return MessageConsumer(
            "orchestrator",
            self.engine,
            self.transport,
            self.app.reply_channels,
            o.on_reply,
            give_up=o.give_up,
            batch=o.batch,
            config=config,
            clock=self.clock,
        )

    def _participant(self, name: str, engine: Engine, config: ConsumerConfig) -> MessageConsumer:
        service = self.services(name)
        return MessageConsumer(
            service.consumer_name,
            engine,
            self.transport,
            [service.participant.channel],
            service.handle,
            give_up=service.give_up,
            dedupe_key=service.dedupe_key,
            batch=service.batch,
            config=config,
            clock=self.clock,
        )

    # -- stepping -------------------------------------------------------------------------------

    def relay_once(self) -> int:
        return sum(relay.run_once().published for relay in self.relays)

    def consume_once(self, select: Callable[[MessageConsumer], bool] = lambda c: True) -> int:
        return sum(c.run_once() for c in self.consumers if select(c))

    def deadlines_once(self) -> int:
        with self.engine.connect() as conn:
            due = store.due(conn, self.clock.now(), 1000)
        moved = 0
        for saga_id in due:
            with self.engine.begin() as conn:
                moved += self.app.orchestrator.on_deadline(conn, saga_id)
        return moved

    def step(self) -> int:
        """One round: relay, then every consumer, then deadlines. Returns how much moved."""
        return self.relay_once() + self.consume_once() + self.deadlines_once()

    def run_until_quiet(self, max_rounds: int = 10_000, advance: float = 0.0) -> int:
        """Step until nothing moves; with ``advance`` also move the clock each idle round so
        back-offs and timeouts come due, until no saga has a deadline left."""
        rounds = 0
        while rounds < max_rounds:
            rounds += 1
            if self.step():
                continue
            if advance and self.next_deadline() is not None:
                self.clock.advance(advance)
                continue
            return rounds
        raise AssertionError(f"still moving after {max_rounds} rounds")

    def next_deadline(self) -> datetime | None:
        import sqlalchemy as sa

        from saga_engine import schema

        with self.engine.connect() as conn:
            value: datetime | None = conn.scalar(
                sa.select(sa.func.min(schema.saga_instances.c.deadline))
            )
            return value

    def close(self) -> None:
        for consumer in self.consumers:
            consumer.close()
