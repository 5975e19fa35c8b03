"""A Hypothesis state machine over the outbox core: writers, relays that crash between publish
and mark, duplicate deliveries, consumers that crash after their commit, and time. After every
step nothing committed is lost, nothing rolled back escapes, no effect is applied twice and each
key's effects keep their write order; once drained, every message is applied exactly once."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from saga_engine import db, schema
from saga_engine.consumer import ConsumerConfig, MessageConsumer
from saga_engine.messages import Envelope
from saga_engine.outbox import OutboxWriter
from saga_engine.outbox.relay import Relay, RelayConfig, to_outgoing
from saga_engine.testing import ManualClock
from saga_engine.testing.faults import SimulatedCrash
from saga_engine.transport.base import OutgoingMessage, PublishResult, Transport
from saga_engine.transport.sql import SqlTransport

pytestmark = [pytest.mark.property, pytest.mark.sqlite]

effects = sa.Table(
    "machine_effects",
    sa.MetaData(),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("message_id", sa.String(64), nullable=False),
    sa.Column("key", sa.String(16), nullable=False),
)
KEYS = st.sampled_from(["k1", "k2", "k3"])


class CrashingBroker(Transport):
    """Publishes for real, then dies before the relay can mark, when armed."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.armed = False

    def publish(self, messages: Any, timeout: float) -> list[PublishResult]:
        results = self.inner.publish(messages, timeout)
        if self.armed:
            self.armed = False
            raise SimulatedCrash("relay killed between publish and mark")
        return results

    def consumer(self, group: str, channels: Any) -> Any:
        return self.inner.consumer(group, channels)


class OutboxMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="outbox-machine-"))
        self.engine = db.create_engine(f"sqlite:///{self.tmp / 'db.sqlite3'}")
        schema.metadata.create_all(self.engine)
        effects.metadata.create_all(self.engine)
        self.clock = ManualClock()
        self.transport = SqlTransport(self.engine, clock=self.clock, listen=False)
        self.broker = CrashingBroker(self.transport)
        self.relay = Relay(
            self.engine, self.broker, RelayConfig(batch_size=4, max_retries=50), clock=self.clock
        )
        self.writer = OutboxWriter(clock=self.clock)
        self.consumer = self._consumer()
        self.committed: list[tuple[str, str]] = []  # (message_id, key) in commit order
        self.rolled_back: set[str] = set()

    def _consumer(self) -> MessageConsumer:
        def apply(conn: sa.Connection, envelope: Envelope) -> None:
            conn.execute(
                effects.insert().values(message_id=envelope.message_id, key=envelope.partition_key)
            )

        return MessageConsumer(
            "machine",
            self.engine,
            self.transport,
            ["events"],
            apply,
            config=ConsumerConfig(batch_size=3, poll_timeout=0.0),
            clock=self.clock,
        )

    # -- rules --------------------------------------------------------------------------------

    @rule(key=KEYS, n=st.integers(1, 3), rollback=st.booleans())
    def write(self, key: str, n: int, rollback: bool) -> None:
        envelopes = [
            Envelope(message_type="E", destination="events", partition_key=key) for _ in range(n)
        ]
        try:
            with self.engine.begin() as conn:
                self.writer.add_many(conn, envelopes)
                if rollback:
                    raise RuntimeError("the business change failed")
        except RuntimeError:
            self.rolled_back |= {e.message_id for e in envelopes}
            return
        self.committed += [(e.message_id, key) for e in envelopes]

    @rule()
    def relay_pass(self) -> None:
        self.relay.run_once()

    @rule()
    def relay_crashes_after_publish(self) -> None:
        self.broker.armed = True
        with contextlib.suppress(SimulatedCrash):
            self.relay.run_once()
        self.broker.armed = False

    @rule(seconds=st.sampled_from([1, 31]))
    def time_passes(self, seconds: int) -> None:
        self.clock.advance(seconds)  # 31 s lets the leases of a crashed relay or consumer expire

    @rule()
    def consume(self) -> None:
        self.consumer.run_once()

    @rule()
    def consumer_crashes_after_commit(self) -> None:
        deliveries = self.consumer.consumer.poll(3, 0.0)
        if deliveries:
            with self.engine.begin() as conn:
                for delivery in deliveries:
                    self.consumer.apply_one(conn, delivery)
            self.consumer.close()  # died before acknowledging: leases run out, messages return
            self.consumer = self._consumer()

    @rule(data=st.data())
    def broker_delivers_a_duplicate(self, data: st.DataObject) -> None:
        o = schema.outbox
        with self.engine.connect() as conn:
            sent = conn.execute(sa.select(o).where(o.c.status == schema.OutboxStatus.SENT)).all()
        if sent:
            row = data.draw(st.sampled_from(sent))
            message: OutgoingMessage = to_outgoing(row)
            self.transport.publish([message], 1.0)

    # -- invariants ---------------------------------------------------------------------------

    def _outbox(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            return dict(
                conn.execute(sa.select(schema.outbox.c.message_id, schema.outbox.c.status)).all()
            )

    def _applied(self) -> list[tuple[str, str]]:
        with self.engine.connect() as conn:
            return [
                tuple(r)
                for r in conn.execute(  # type: ignore[misc]
                    sa.select(effects.c.message_id, effects.c.key).order_by(effects.c.seq)
                )
            ]

    @invariant()
    def nothing_committed_is_lost_and_nothing_rolled_back_escapes(self) -> None:
        outbox = self._outbox()
        assert {m for m, _ in self.committed} == set(outbox)
        assert not self.rolled_back & set(outbox)
        assert schema.OutboxStatus.FAILED not in outbox.values()

    @invariant()
    def effects_once_and_in_key_order(self) -> None:
        applied = self._applied()
        ids = [m for m, _ in applied]
        assert len(ids) == len(set(ids)), "an effect was applied twice"
        order = {m: i for i, (m, _) in enumerate(self.committed)}
        for key in {k for _, k in applied}:
            seen = [order[m] for m, k in applied if k == key]
            assert seen == sorted(seen), f"key {key} applied out of order"

    def teardown(self) -> None:
        try:
            for _ in range(200):  # drain: every committed message is applied exactly once
                self.clock.advance(31)
                moved = self.relay.run_once().published + self.consumer.run_once()
                if not moved and len(self._applied()) == len(self.committed):
                    break
            assert sorted(self._applied()) == sorted(self.committed)
        finally:
            self.consumer.close()
            self.engine.dispose()
            shutil.rmtree(self.tmp, ignore_errors=True)


TestOutboxMachine = OutboxMachine.TestCase
CI_PROFILE = settings.default.max_examples >= 500  # tests/property/conftest.py's "ci"
TestOutboxMachine.settings = settings(
    settings.default,
    max_examples=200 if CI_PROFILE else 25,
    stateful_step_count=30,
    deadline=None,
)
