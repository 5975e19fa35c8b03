"""Property-test your own sagas under injected failures.

    from hypothesis import given, settings
    from saga_engine.testing import fault_schedules, simulate

    @given(schedule=fault_schedules(order_fulfilment))
    @settings(max_examples=200, deadline=None)
    def test_order_saga_survives_any_fault(schedule):
        run = simulate(app, order_fulfilment, [sample_order()], schedule, setup=seed)
        run.assert_invariants(domain=check_invariants)

``simulate`` runs the real engine (relay, transport, inbox, orchestrator, participants) on a fresh
SQLite file (or a database you name) with a :class:`ManualClock`, one component at a time in an order
drawn from the schedule's seed, and injects the schedule's faults at the engine's seams: participant
and local-step handlers, the relay's broker, and the consumers' commits. When a property fails,
Hypothesis shrinks the schedule to a short, readable one, e.g.
``FaultSchedule(faults=(RelayCrash(nth=1), Reject(step='charge_payment')), seed=0)``, which you can
paste into a plain test to replay the run exactly.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from hypothesis import strategies as st
from pydantic import BaseModel
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from saga_engine import db, errors, orchestrator, schema
from saga_engine.app import App
from saga_engine.consumer import MessageConsumer
from saga_engine.definition import Local, Saga, Step, StepKind
from saga_engine.messages import Envelope, Message
from saga_engine.participant import Participant, ParticipantService, _Handler
from saga_engine.testing.runtime import ManualClock, Runtime
from saga_engine.transport.base import OutgoingMessage, PublishResult, Transport

DO, UNDO = "do", "undo"
Starter = Callable[[App, Connection, Any], str]

# -- the faults ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reject:
    """The step's handler (or its compensation's, with phase='undo') rejects its first ``times`` runs."""

    step: str
    phase: str = DO
    times: int = 1


@dataclasses.dataclass(frozen=True)
class Transient:
    """The participant's handler raises a non-business error its first ``times`` runs."""

    step: str
    phase: str = DO
    times: int = 1


@dataclasses.dataclass(frozen=True)
class Duplicate:
    """The ``nth`` message the relay publishes reaches the broker twice."""

    nth: int


@dataclasses.dataclass(frozen=True)
class ConsumerCrash:
    """The consumer of the ``nth`` batch dies before (or after) its local commit, before it
    acknowledges the batch: it comes again."""

    nth: int
    after_commit: bool = False


@dataclasses.dataclass(frozen=True)
class RelayCrash:
    """The relay dies in its ``nth`` publish, after the broker took the batch, before marking it."""

    nth: int


@dataclasses.dataclass(frozen=True)
class BrokerOutage:
    """Publishes ``first`` .. ``first + passes - 1`` cannot reach the broker."""

    first: int
    passes: int


@dataclasses.dataclass(frozen=True)
class Delay:
    """The step's command is held back past the step's timeout before it is delivered."""

    step: str


Fault = Reject | Transient | Duplicate | ConsumerCrash | RelayCrash | BrokerOutage | Delay


@dataclasses.dataclass(frozen=True)
class FaultSchedule:
    """Faults to inject, and the seed of the interleaving (component order, cross-saga order)."""

    faults: tuple[Fault, ...] = ()
    seed: int = 0

    def of(self, kind: type[Any]) -> list[Any]:
        return [f for f in self.faults if isinstance(f, kind)]


def fault_schedules(saga: Saga[Any], *, max_faults: int = 4) -> st.SearchStrategy[FaultSchedule]:
    """Hypothesis strategy: schedules of faults that make sense for ``saga``."""
    every = [s.name for s in saga.steps]
    remote = [s.name for s in saga.steps if not isinstance(s.action, Local)]
    undo = [
        s.name
        for s in saga.steps
        if s.compensation is not None and saga.index_of(s.name) < saga.pivot_index
    ]
    remote_undo = [
        s.name for s in saga.steps if s.name in undo and not isinstance(s.compensation, Local)
    ]
    timed = [s.name for s in saga.steps if s.timeout_seconds is not None]
    options: list[st.SearchStrategy[Fault]] = [
        st.builds(Reject, st.sampled_from(every), st.just(DO), st.integers(1, 2)),
        st.builds(Duplicate, st.integers(1, 15)),
        st.builds(ConsumerCrash, st.integers(1, 15), st.booleans()),
        st.builds(RelayCrash, st.integers(1, 10)),
        st.builds(BrokerOutage, st.integers(1, 8), st.integers(1, 4)),
    ]
    if remote:
        options.append(
            st.builds(Transient, st.sampled_from(remote), st.just(DO), st.integers(1, 3))
        )
    if undo:
        options.append(
            st.builds(
                Reject,
                st.sampled_from(undo),
                st.just(UNDO),
                st.integers(1, saga.retry.max_attempts),
            )
        )
    if remote_undo:
        options.append(
            st.builds(Transient, st.sampled_from(remote_undo), st.just(UNDO), st.integers(1, 3))
        )
    if timed:
        options.append(st.builds(Delay, st.sampled_from(timed)))
    faults = st.lists(st.one_of(options), max_size=max_faults).map(tuple)
    return st.builds(FaultSchedule, faults, st.integers(0, 2**16))


# -- the simulator ------------------------------------------------------------------------------

_journal_md = sa.MetaData()
journal = sa.Table(
    "simulation_journal",
    _journal_md,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("saga_id", sa.String(64), nullable=False),
    sa.Column("step", sa.String(128), nullable=False),
    sa.Column("phase", sa.String(8), nullable=False),
)
received = sa.Table(
    "simulation_received",
    _journal_md,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("destination", sa.String(255), nullable=False),
    sa.Column("partition_key", sa.String(255), nullable=False),
    sa.Column("message_id", sa.String(64), nullable=False),
)

_current: contextvars.ContextVar[Envelope] = contextvars.ContextVar("simulated_command")


# A throwaway database needs no durability: memory-backed files and no fsync make a run ~5x faster.
_FAST_DIR = "/dev/shm" if Path("/dev/shm").is_dir() else None


def _no_fsync(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.execute("PRAGMA synchronous=OFF")


_templates: dict[tuple[str, ...], Path] = {}


def _template(app: App) -> Path:
    """An SQLite file with the app's schema, made once per process and copied for each run
    (creating a dozen tables costs more than a whole simulated saga)."""
    key = (app.name, *sorted(app.sagas), *sorted(app.participants))
    if key not in _templates or not _templates[key].exists():
        path = Path(tempfile.mkdtemp(prefix="saga-sim-template-", dir=_FAST_DIR)) / "t.sqlite3"
        engine = db.create_engine(f"sqlite:///{path}")
        app.create_tables(engine)
        _journal_md.create_all(engine)
        engine.dispose()
        _templates[key] = path
    return _templates[key]


class SimulatedCrash(BaseException):
    """A process dying: a BaseException so that no ``except Exception`` in the engine absorbs it."""


class _Injector:
    """Decides, at each seam, whether the schedule wants a fault there now."""

    def __init__(self, schedule: FaultSchedule) -> None:
        self.schedule = schedule
        self.runs: Counter[tuple[str, str, str]] = Counter()
        self.publishes = 0
        self.batches = 0
        self.delayed: set[str] = set()

    def before_handler(self, saga_id: str, step: str, phase: str) -> None:
        key = (saga_id, step, phase)
        self.runs[key] += 1
        n = self.runs[key]
        for fault in self.schedule.of(Reject):
            if (fault.step, fault.phase) == (step, phase) and n <= fault.times:
                raise errors.Rejected(f"injected rejection #{n} of {step}/{phase}")
        for fault in self.schedule.of(Transient):
            if (fault.step, fault.phase) == (step, phase) and n <= fault.times:
                raise RuntimeError(f"injected transient error #{n} of {step}/{phase}")


class _FaultyBroker(Transport):
    """The relay's view of the broker: outages, crashes after publishing, duplicated messages."""

    def __init__(self, inner: Transport, injector: _Injector) -> None:
        self.inner = inner
        self.injector = injector
        self.sent = 0

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        i = self.injector
        i.publishes += 1
        if any(f.first <= i.publishes < f.first + f.passes for f in i.schedule.of(BrokerOutage)):
            return [
                PublishResult(m.message_id, "injected broker outage", unreachable=True)
                for m in messages
            ]
        extra = [
            m
            for n, m in enumerate(messages, self.sent + 1)
            if any(f.nth == n for f in i.schedule.of(Duplicate))
        ]
        self.sent += len(messages)
        results = self.inner.publish([*messages, *extra], timeout)[: len(messages)]
        if any(f.nth == i.publishes for f in i.schedule.of(RelayCrash)):
            raise SimulatedCrash(f"relay killed after publish #{i.publishes}")
        return results

    def consumer(self, group: str, channels: Sequence[str]) -> Any:
        return self.inner.consumer(group, channels)


class _Service(ParticipantService):
    def handle(self, conn: Connection, envelope: Envelope) -> None:
        conn.execute(
            received.insert().values(
                destination=envelope.destination,
                partition_key=envelope.partition_key,
                message_id=envelope.message_id,
            )
        )
        token = _current.set(envelope)
        try:
            super().handle(conn, envelope)
        finally:
            _current.reset(token)


def _wrap_participant(p: Participant, injector: _Injector) -> Participant:
    copy = Participant(p.name, metadata=p.metadata)
    for message_type, handler in p.handlers.items():
        copy.handlers[message_type] = _Handler(
            handler.command_type, _wrapped_handler(handler.function, injector)
        )
    return copy


def _wrapped_handler(function: Callable[[Any, Session], Any], injector: _Injector) -> Any:
    def run(command: Message, session: Session) -> Any:
        h = _current.get().headers
        injector.before_handler(h["saga_id"], h["step"], h["phase"])
        result = function(command, session)
        session.execute(
            journal.insert().values(saga_id=h["saga_id"], step=h["step"], phase=h["phase"])
        )
        return result

    return run


def _wrap_saga(saga: Saga[Any], injector: _Injector) -> Saga[Any]:
    steps = []
    for s in saga.steps:
        changes: dict[str, Any] = {}
        if isinstance(s.action, Local):
            changes["action"] = Local(_wrapped_local(s.action.action, s.name, DO, injector))
        if isinstance(s.compensation, Local):
            changes["compensation"] = Local(
                _wrapped_local(s.compensation.action, s.name, UNDO, injector)
            )
        steps.append(dataclasses.replace(s, **changes))
    return Saga(saga.name, data=saga.data_type, steps=steps, version=saga.version, retry=saga.retry)


def _wrapped_local(
    function: Callable[[Any, Session], Any], step: str, phase: str, injector: _Injector
) -> Any:
    def run(data: Any, session: Session) -> Any:
        saga_id = orchestrator.current_saga_id()
        injector.before_handler(saga_id, step, phase)
        result = function(data, session)
        session.execute(journal.insert().values(saga_id=saga_id, step=step, phase=phase))
        return result

    return run


class Simulation:
    """One run of ``app`` under a fault schedule; see :func:`simulate`."""

    def __init__(
        self,
        app: App,
        saga: Saga[Any],
        data: Sequence[BaseModel | dict[str, Any]],
        schedule: FaultSchedule,
        *,
        setup: Callable[[Engine], None] | None = None,
        start: Starter | None = None,
        db_url: str | None = None,
        max_rounds: int = 5000,
    ) -> None:
        self.schedule = schedule
        self.injector = _Injector(schedule)
        self.rng = random.Random(schedule.seed)
        self.clock = ManualClock()
        self.max_rounds = max_rounds
        self.original = saga
        self.app = app.replace(
            sagas=[_wrap_saga(s, self.injector) for s in app.sagas.values()],
            participants=[_wrap_participant(p, self.injector) for p in app.participants.values()],
            clock=self.clock,
        )
        self.saga = self.app.saga(saga.name)
        self._tmp = None if db_url else Path(tempfile.mkdtemp(prefix="saga-sim-", dir=_FAST_DIR))
        url = db_url or f"sqlite:///{self._tmp}/simulation.sqlite3"
        if self._tmp is not None:
            shutil.copyfile(_template(self.app), self._tmp / "simulation.sqlite3")
        self.engine = db.create_engine(url)
        if db_url is None:
            sa.event.listen(self.engine, "connect", _no_fsync)
        else:
            self.app.create_tables(self.engine)
            _journal_md.create_all(self.engine)
        if setup is not None:
            setup(self.engine)
        self.runtime = Runtime(
            self.app,
            self.engine,
            clock=self.clock,
            services=lambda name: _Service(
                self.app.participants[name], writer=self.app.writer, clock=self.clock
            ),
            relay_transport=lambda inner: _FaultyBroker(inner, self.injector),
            seed=schedule.seed,
        )
        self.starter = start or (lambda app, conn, item: app.start(conn, self.saga, item))
        self.saga_ids = [self._start(item) for item in data]
        self.settled = False
        self.rounds = 0

    def _start(self, item: BaseModel | dict[str, Any]) -> str:
        with self.engine.begin() as conn:
            return self.starter(self.app, conn, item)

    # -- running --------------------------------------------------------------------------------

    def run(self) -> Simulation:
        while self.rounds < self.max_rounds:
            self.rounds += 1
            if self._round():
                continue
            if not self._advance_clock():
                self.settled = True
                return self
        return self

    def _round(self) -> int:
        actions: list[Callable[[], int]] = [self._relay, self.runtime.deadlines_once]
        actions += [lambda c=c: self._consume(c) for c in self.runtime.consumers]  # type: ignore[misc]
        self.rng.shuffle(actions)
        return sum(action() for action in actions)

    def _relay(self) -> int:
        try:
            return self.runtime.relay_once()
        except SimulatedCrash:
            return 1  # the crash itself is progress: its leases must run out before a retry

    def _consume(self, c: MessageConsumer) -> int:
        deliveries = c.consumer.poll(c.config.batch_size, 0.0)
        if not deliveries:
            return 0
        deliveries = self._hold_delayed(c, deliveries)
        if not deliveries:
            return 1
        deliveries = self._shuffle_across_keys(deliveries)
        self.injector.batches += 1
        crash = next(
            (f for f in self.schedule.of(ConsumerCrash) if f.nth == self.injector.batches), None
        )
        if crash is None:
            c.apply(deliveries)
        elif crash.after_commit:
            try:
                with c.engine.begin() as conn:
                    for delivery in deliveries:
                        c.apply_one(conn, delivery)
            except Exception:
                pass  # a handler failed: nothing committed, same as dying before the commit
            c.consumer.release(deliveries)  # died before acknowledging: all of it comes again
        else:
            c.consumer.release(deliveries)
        return len(deliveries)

    def _hold_delayed(self, c: MessageConsumer, deliveries: list[Any]) -> list[Any]:
        """Hold back a delayed step's command once, while the clock runs past its timeout."""
        delayed = {f.step for f in self.schedule.of(Delay)}
        if not delayed:
            return deliveries
        for index, delivery in enumerate(deliveries):
            envelope = Envelope.from_wire(delivery.value)
            step = envelope.headers.get("step", "")
            key = envelope.headers.get("command_id", envelope.message_id)
            if (
                step in delayed
                and envelope.headers.get("phase") == DO
                and key not in self.injector.delayed
            ):
                self.injector.delayed.add(key)
                c.consumer.release(deliveries[index:])
                timeout = self.saga.step_named(step).timeout_seconds or 0
                self.clock.advance(timeout + 1)
                return deliveries[:index]
        return deliveries

    def _shuffle_across_keys(self, deliveries: list[Any]) -> list[Any]:
        """Reorder messages of different sagas; each saga's own messages keep their order."""
        by_key: dict[str, list[Any]] = {}
        for delivery in deliveries:
            by_key.setdefault(delivery.partition_key, []).append(delivery)
        lanes = list(by_key.values())
        out = []
        while lanes:
            lane = self.rng.choice(lanes)
            out.append(lane.pop(0))
            if not lane:
                lanes.remove(lane)
        return out

    def _advance_clock(self) -> bool:
        """Jump to the next moment something is due (deadline, retry, lease); False if none."""
        now = self.clock.now()
        o, s, q = schema.outbox, schema.saga_instances, schema.transport_messages
        pending = o.c.status == schema.OutboxStatus.PENDING
        later = [
            sa.select(sa.func.min(s.c.deadline)).where(s.c.deadline > now),
            sa.select(sa.func.min(o.c.next_retry_at)).where(pending, o.c.next_retry_at > now),
            sa.select(sa.func.min(o.c.lease_until)).where(pending, o.c.lease_until > now),
            sa.select(sa.func.min(q.c.lease_until)).where(q.c.lease_until > now),
        ]
        with self.engine.connect() as conn:
            candidates = [conn.scalar(query) for query in later]
        due = [c for c in candidates if c is not None]
        if not due:
            return False
        self.clock.current = min(due) + timedelta(milliseconds=1)
        return True

    # -- checking -------------------------------------------------------------------------------

    def violations(self, domain: Callable[[Engine], list[str]] | None = None) -> list[str]:
        found = [] if self.settled else [f"did not settle within {self.max_rounds} rounds"]
        with self.engine.connect() as conn:
            found += self._terminal(conn)
            found += self._compensations(conn)
            found += self._effects_once(conn)
            found += self._nothing_lost(conn)
            found += self._order_kept(conn)
        if domain is not None:
            found += [f"domain: {v}" for v in domain(self.engine)]
        return found

    def assert_invariants(self, domain: Callable[[Engine], list[str]] | None = None) -> None:
        """Raise AssertionError listing every violated invariant; always cleans up."""
        try:
            found = self.violations(domain)
            assert not found, f"{self.schedule}:\n  " + "\n  ".join(found)
        finally:
            self.close()

    def states(self, conn: Connection | None = None) -> dict[str, str]:
        s = schema.saga_instances
        with self.engine.connect() as c:
            return dict(c.execute(sa.select(s.c.id, s.c.state)).all())

    def _terminal(self, conn: Connection) -> list[str]:
        out = []
        # FAILED is the right end only when a compensation was made to fail every attempt.
        limit = self.saga.retry.max_attempts
        may_fail = any(f.phase == UNDO and f.times >= limit for f in self.schedule.of(Reject))
        # ...or a retriable step with an attempt limit was made to fail that often.
        may_fail = may_fail or any(
            f.phase == DO
            and (n := self.saga.step_named(f.step).max_attempts) is not None
            and f.times >= n
            for f in self.schedule.of(Reject)
        )
        for saga_id, state in self.states().items():
            if state not in ("COMPLETED", "COMPENSATED", "FAILED"):
                out.append(f"saga {saga_id} stuck in {state}")
            elif state == "FAILED" and not may_fail:
                out.append(f"saga {saga_id} FAILED although no compensation kept failing")
        return out

    def _journal(self, conn: Connection) -> dict[str, list[tuple[str, str]]]:
        rows = conn.execute(
            sa.select(journal.c.saga_id, journal.c.step, journal.c.phase).order_by(journal.c.seq)
        ).all()
        by_saga: dict[str, list[tuple[str, str]]] = {}
        for saga_id, step, phase in rows:
            by_saga.setdefault(saga_id, []).append((step, phase))
        return by_saga

    def _compensations(self, conn: Connection) -> list[str]:
        out = []
        states = self.states()
        for saga_id, entries in self._journal(conn).items():
            done = [s for s, p in entries if p == DO and self._compensatable(s)]
            undone = [s for s, p in entries if p == UNDO]
            expected = list(reversed(done))
            state = states.get(saga_id)
            timed_out = {s.name for s in self.saga.steps if s.on_timeout.value == "fail"}
            undone_known = [s for s in undone if s in done or s not in timed_out]
            if state == "COMPLETED" and undone:
                out.append(f"saga {saga_id} COMPLETED but compensated {undone}")
            elif state == "COMPENSATED" and undone_known != expected:
                out.append(f"saga {saga_id}: compensations {undone} != reverse of {done}")
            elif state == "FAILED" and undone_known != expected[: len(undone_known)]:
                out.append(f"saga {saga_id}: compensations {undone} not in reverse of {done}")
        return out

    def _compensatable(self, step_name: str) -> bool:
        s: Step = self.saga.step_named(step_name)
        return (
            s.compensation is not None
            and s.kind is not StepKind.RETRIABLE
            and self.saga.index_of(step_name) < self.saga.pivot_index
        )

    def _effects_once(self, conn: Connection) -> list[str]:
        counts = Counter(
            conn.execute(sa.select(journal.c.saga_id, journal.c.step, journal.c.phase)).all()
        )
        return [f"effect {key} applied {n} times" for key, n in counts.items() if n > 1]

    def _nothing_lost(self, conn: Connection) -> list[str]:
        o = schema.outbox
        out = []
        unsent = conn.execute(
            sa.select(o.c.message_id, o.c.status).where(o.c.status != schema.OutboxStatus.SENT)
        ).all()
        out += [f"outbox message {m} left in status {st}" for m, st in unsent]
        left = conn.scalar(sa.select(sa.func.count()).select_from(schema.transport_messages))
        if left:
            out.append(f"{left} delivered message(s) never consumed")
        seen = set(conn.scalars(sa.select(schema.inbox.c.message_id)))
        for message_id, headers in conn.execute(sa.select(o.c.message_id, o.c.headers)):
            key = _command_id(headers) or message_id  # participants deduplicate by command id
            if key not in seen:
                out.append(f"outbox message {message_id} never reached its consumer's inbox")
        return out

    def _order_kept(self, conn: Connection) -> list[str]:
        o = schema.outbox
        position = dict(conn.execute(sa.select(o.c.message_id, o.c.id)).all())
        lanes: dict[tuple[str, str], list[int]] = {}
        for dest, key, message_id in conn.execute(
            sa.select(
                received.c.destination, received.c.partition_key, received.c.message_id
            ).order_by(received.c.seq)
        ):
            lanes.setdefault((dest, key), []).append(position.get(message_id, -1))
        return [
            f"messages to {dest} for {key} processed out of order: {ids}"
            for (dest, key), ids in lanes.items()
            if ids != sorted(ids)
        ]

    def close(self) -> None:
        self.runtime.close()
        self.engine.dispose()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _command_id(headers_json: str) -> str | None:
    """The command id of a command (replies carry it too, but are deduplicated by message id)."""
    headers = json.loads(headers_json)
    return str(headers["command_id"]) if "reply_to" in headers else None


def simulate(
    app: App,
    saga: Saga[Any],
    data: Sequence[Any] | BaseModel,
    schedule: FaultSchedule,
    *,
    setup: Callable[[Engine], None] | None = None,
    start: Starter | None = None,
    db_url: str | None = None,
) -> Simulation:
    """Run ``saga`` of ``app`` for each item of ``data`` under ``schedule``; check the result with
    :meth:`Simulation.assert_invariants`.

    ``setup(engine)`` seeds your business tables; ``start(app, conn, item)`` starts one saga and
    returns its id (default: ``app.start(conn, saga, item)``) — use it when your service writes
    its own rows in the same transaction, as an order service does.
    """
    items = [data] if isinstance(data, BaseModel) else list(data)
    return Simulation(app, saga, items, schedule, setup=setup, start=start, db_url=db_url).run()
