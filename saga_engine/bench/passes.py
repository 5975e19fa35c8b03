"""``saga-engine bench pass``: what one relay pass costs, statement by statement.

The other benchmarks measure the relay among writers, consumers and the broker, on a machine they
keep busy. This one times the relay alone: before each pass it commits ``rows`` messages, then
runs one pass of the engine's :class:`Relay` (claim, order guard, publish, mark, commit) and
notes the wall time of each statement, of the publish call, and the process's CPU time. Sizes are
those of a relay at a steady rate (a few rows per wake-up) and of a polling relay (hundreds per
poll), so the figures say where a pass's time goes at each, without contention. Each size starts
from an empty, vacuumed outbox, and its acknowledged rows go where ``--on-sent`` puts them, as in a
relay's database: to ``outbox_history`` by default on PostgreSQL, kept as SENT with ``mark``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy import Connection, Engine

from saga_engine import errors
from saga_engine.bench import env, workload
from saga_engine.bench.procs import warm_up
from saga_engine.bench.report import Report, percentile
from saga_engine.outbox import claim as claims
from saga_engine.outbox import relay as relays
from saga_engine.outbox.relay import Relay, RelayConfig
from saga_engine.outbox.writer import OutboxWriter
from saga_engine.transport.base import Consumer, OutgoingMessage, PublishResult, Transport

#: The statements of a pass, by what they do; anything else (BEGIN, commit) is in ``rest``.
STEPS = ("claim", "guard", "publish", "mark")
TOPIC = "bench.pass"
WARM_UP_PASSES = 10


@dataclasses.dataclass
class Options:
    db: str
    broker: str = env.TANSU
    rows: tuple[int, ...] = (1, 15, 300)
    passes: int = 200
    payload_bytes: int = 200
    on_sent: str = "auto"
    keep_db: bool = False

    def __post_init__(self) -> None:
        if not self.rows or min(self.rows) < 1 or max(self.rows) > 500:
            raise errors.ConfigurationError("--rows: sizes from 1 to 500 (the relay's batch)")
        if self.passes < 1:
            raise errors.ConfigurationError("--passes must be at least 1")


def run(options: Options, report: Report) -> bool:
    with env.world(options.db, options.broker, keep_db=options.keep_db) as (url, engine, broker):
        return Bench(options, report, url, engine, broker).run()


class StepClock:
    """Adds up the wall time a relay's connections spend in each kind of statement."""

    def __init__(self, relay_engine: Engine) -> None:
        self.seconds = dict.fromkeys(STEPS, 0.0)
        self._started = 0.0
        sa.event.listen(relay_engine, "before_cursor_execute", self._before)
        sa.event.listen(relay_engine, "after_cursor_execute", self._after)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(STEPS, 0.0)

    def _before(self, *_args: Any) -> None:
        self._started = time.perf_counter()

    def _after(
        self,
        conn: Connection,
        _cursor: Any,
        _sql: str,
        _parameters: Any,
        context: Any,
        _executemany: bool,
    ) -> None:
        took = time.perf_counter() - self._started
        compiled = getattr(context, "compiled", None)  # None for driver SQL (BEGIN, commit)
        kind = step_of(conn, compiled.statement) if compiled is not None else None
        if kind is not None:
            self.seconds[kind] += took


def step_of(conn: Connection, statement: object) -> str | None:
    """Which step of a locked (SKIP LOCKED) pass ``statement`` is, if it is one of them."""
    claim = claims.statements(conn)
    if statement is claim.claim or statement is claim.guarded_claim:
        return "claim"  # on PostgreSQL with the guard in it
    if statement is claim.guard:
        return "guard"
    marks = relays.mark_statements(conn, owned=False)
    if any(statement is mark for mark in (marks.sent, marks.deleted, *marks.archived)):
        return "mark"
    return None


class TimedTransport(Transport):
    """The bench's transport, with the wall time of every publish call added up."""

    def __init__(self, inner: Transport, clock: StepClock) -> None:
        self.inner, self.clock = inner, clock
        self.name = inner.name
        self.atomic_publish = inner.atomic_publish

    def publish(self, messages: Sequence[OutgoingMessage], timeout: float) -> list[PublishResult]:
        started = time.perf_counter()
        try:
            return self.inner.publish(messages, timeout)
        finally:
            self.clock.seconds["publish"] += time.perf_counter() - started

    def consumer(self, group: str, channels: Sequence[str]) -> Consumer:
        return self.inner.consumer(group, channels)

    def close(self) -> None:
        self.inner.close()


class Bench:
    def __init__(
        self, options: Options, report: Report, url: str, engine: Engine, broker: env.Broker
    ) -> None:
        self.o, self.report = options, report
        self.url, self.engine, self.broker = url, engine, broker
        self.writer = OutboxWriter()
        self.written = 0

    def run(self) -> bool:
        o, report = self.o, self.report
        report.figure("passes", o.passes, "timed passes per size")
        config = RelayConfig(on_sent=o.on_sent)
        relay_engine = relays.relay_engine(self.url, config.pool_size)
        clock = StepClock(relay_engine)
        transport = TimedTransport(_transport(self.broker.url), clock)
        relay = Relay(relay_engine, transport, config)
        report.figure("on_sent", relay.on_sent, "acknowledged rows are")
        try:
            sizes = [self._size(relay, clock, rows) for rows in o.rows]  # every size, always
            return all(sizes)
        finally:
            transport.close()
            relay_engine.dispose()

    def _size(self, relay: Relay, clock: StepClock, rows: int) -> bool:
        report, key, passes = self.report, f"rows_{rows}", self.o.passes
        report.section(f"{rows} row(s) per pass, {passes} passes, nothing else running")
        env.empty_outbox(self.engine)  # whatever ran before this size
        healthy = True
        for _ in range(WARM_UP_PASSES):  # connections, prepared statements, topic metadata
            healthy &= self._pass(relay, rows).published == rows
        clock.reset()
        timed = [self._pass(relay, rows) for _ in range(passes)]
        healthy &= all(one.published == rows for one in timed)
        walls = [one.wall_s for one in timed]
        mean_ms = 1000 * sum(walls) / passes
        report.figure(f"{key}_pass_ms", mean_ms, "pass, mean", "ms")
        report.figure(f"{key}_pass_p99_ms", 1000 * percentile(walls, 0.99), "pass, p99", "ms")
        steps = {step: 1000 * seconds / passes for step, seconds in clock.seconds.items()}
        for step in STEPS:
            report.figure(f"{key}_{step}_ms", steps[step], f"  {step}, mean", "ms")
        rest = mean_ms - sum(steps.values())
        report.figure(f"{key}_rest_ms", rest, "  the rest (BEGIN, commit, Python)", "ms")
        cpu_ms = 1000 * sum(one.cpu_s for one in timed) / passes
        report.figure(f"{key}_cpu_ms", cpu_ms, "relay process CPU per pass", "ms")
        report.figure(f"{key}_cpu_ms_per_message", cpu_ms / rows, "relay CPU per message", "ms")
        if not healthy:
            report.note("a pass did not publish every row it was given: see the log")
        return healthy

    def _pass(self, relay: Relay, rows: int) -> TimedPass:
        """Commit ``rows`` messages, then one relay pass, timed."""
        self._write(rows)
        cpu, wall = time.process_time(), time.perf_counter()
        outcome = relay.run_once()
        return TimedPass(outcome.published, time.perf_counter() - wall, time.process_time() - cpu)

    def _write(self, rows: int) -> None:
        first, self.written = self.written, self.written + rows
        envelopes = [
            workload.envelope(TOPIC, workload.order_key(i), self.o.payload_bytes)
            for i in range(first, self.written)
        ]
        with self.engine.begin() as conn:
            self.writer.add_many(conn, envelopes)


class TimedPass(NamedTuple):
    published: int
    wall_s: float
    cpu_s: float


def _transport(url: str) -> Transport:
    from saga_engine import transport

    kafka = transport.from_url(url)
    warm_up(kafka, TOPIC)
    return kafka
