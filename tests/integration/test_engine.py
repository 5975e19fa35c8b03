"""The orchestrator, participants and store on each real database, stepped deterministically."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.orm import Session

from saga_engine import db, errors, schema, store
from saga_engine.app import App
from saga_engine.consumer import ConsumerConfig
from saga_engine.definition import Retry, Saga, step
from saga_engine.messages import Envelope, Message
from saga_engine.participant import Participant
from saga_engine.testing import ManualClock, Runtime

effects = sa.Table(
    "test_effects",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("saga", sa.String(64)),
    sa.Column("what", sa.String(64)),
)


class Data(BaseModel):
    order: str
    reject_at: str | None = None  # step whose participant rejects
    transient_at: str | None = None  # step whose participant raises a transient error
    reject_undo: bool = False  # compensation of step a rejects
    express: bool = False
    charge_id: str | None = None


class Do(Message):
    order: str
    step: str
    reject: bool
    transient: bool = False


class Undo(Message):
    order: str
    step: str
    reject: bool = False


class Charged(Message):
    charge_id: str


def record(tx: Session, order: str, what: str) -> None:
    tx.execute(effects.insert().values(saga=order, what=what))


def make_participant(name: str, calls: dict[str, int]) -> Participant:
    p = Participant(name)

    @p.handles(Do)
    def do(cmd: Do, tx: Session) -> Message | None:
        record(tx, cmd.order, f"do {cmd.step}")  # rolled back with the savepoint on reject
        if cmd.transient:
            calls[cmd.order] = calls.get(cmd.order, 0) + 1
            raise RuntimeError("database hiccup")
        if cmd.reject:
            raise errors.Rejected(f"{cmd.step} refused")
        return Charged(charge_id=f"ch-{cmd.order}") if cmd.step == "b" else None

    @p.handles(Undo)
    def undo(cmd: Undo, tx: Session) -> None:
        if cmd.reject:
            raise errors.Rejected("cannot undo")
        record(tx, cmd.order, f"undo {cmd.step}")

    return p


def command(name: str) -> Any:
    return lambda d: Do(
        order=d.order, step=name, reject=d.reject_at == name, transient=d.transient_at == name
    )


def build_app(clock: ManualClock, calls: dict[str, int]) -> tuple[App, Saga[Data]]:
    saga: Saga[Data] = Saga(
        "test_saga",
        data=Data,
        retry=Retry(base_seconds=1, max_attempts=3),
        steps=[
            step("a")
            .invoke("alpha", command("a"))
            .compensate("alpha", lambda d: Undo(order=d.order, step="a", reject=d.reject_undo)),
            step("x")
            .when(lambda d: d.express)
            .invoke("alpha", command("x"))
            .compensate("alpha", lambda d: Undo(order=d.order, step="x")),
            step("l")
            .local(lambda d, tx: record(tx, d.order, "do l"))
            .compensate(lambda d, tx: record(tx, d.order, "undo l")),
            step("b")
            .invoke("beta", command("b"), reply=Charged)
            .on_reply(lambda d, r: d.model_copy(update={"charge_id": r.charge_id}))
            .pivot(),
            step("c").invoke("beta", command("c")).retriable(),
        ],
    )
    app = App(
        "t",
        sagas=[saga],
        participants=[make_participant("alpha", calls), make_participant("beta", calls)],
        metadata=[effects.metadata],
        clock=clock,
        consumer=ConsumerConfig(max_attempts=3),
    )
    return app, saga


@pytest.fixture
def world(db_url: str) -> Iterator[tuple[Runtime, App, Saga[Data], sa.Engine]]:
    clock = ManualClock()
    app, saga = build_app(clock, {})
    engine = db.create_engine(db_url)
    app.create_tables(engine)
    runtime = Runtime(app, engine, clock=clock)
    yield runtime, app, saga, engine
    runtime.close()
    engine.dispose()


def start(app: App, engine: sa.Engine, saga: Saga[Data], **data: Any) -> str:
    with engine.begin() as conn:
        return app.start(conn, saga, Data(**data))


def effects_of(engine: sa.Engine, order: str) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.scalars(
                sa.select(effects.c.what).where(effects.c.saga == order).order_by(effects.c.id)
            )
        )


def instance(engine: sa.Engine, saga_id: str) -> store.SagaInstance:
    with engine.connect() as conn:
        found = store.load(conn, saga_id)
    assert found is not None
    return found


def test_happy_path_runs_every_step_once(world: Any) -> None:
    runtime, app, saga, engine = world
    sid = start(app, engine, saga, order="o1")
    runtime.run_until_quiet()
    assert instance(engine, sid).state == "COMPLETED"
    assert instance(engine, sid).data["charge_id"] == "ch-o1"
    assert effects_of(engine, "o1") == ["do a", "do l", "do b", "do c"]


def test_failure_before_pivot_compensates_in_reverse(world: Any) -> None:
    runtime, app, saga, engine = world
    sid = start(app, engine, saga, order="o2", reject_at="b", express=True)
    runtime.run_until_quiet()
    found = instance(engine, sid)
    assert found.state == "COMPENSATED"
    assert "b refused" in (found.last_error or "")
    # b's own write was rolled back with its savepoint; the others are undone newest first.
    assert effects_of(engine, "o2") == ["do a", "do x", "do l", "undo l", "undo x", "undo a"]


def test_skipped_step_is_never_compensated(world: Any) -> None:
    runtime, app, saga, engine = world
    start(app, engine, saga, order="o3", reject_at="b", express=False)
    runtime.run_until_quiet()
    assert effects_of(engine, "o3") == ["do a", "do l", "undo l", "undo a"]


def test_failure_of_first_step_compensates_nothing(world: Any) -> None:
    runtime, app, saga, engine = world
    sid = start(app, engine, saga, order="o4", reject_at="a")
    runtime.run_until_quiet()
    assert instance(engine, sid).state == "COMPENSATED"
    assert effects_of(engine, "o4") == []


def test_retriable_step_after_pivot_is_retried_until_it_succeeds(world: Any) -> None:
    runtime, app, saga, engine = world
    sid = start(app, engine, saga, order="o5", reject_at="c")
    runtime.run_until_quiet()
    found = instance(engine, sid)
    assert found.state == "c" and found.deadline_kind == "retry"
    with engine.begin() as conn:  # the participant's problem goes away; the saga data says so
        conn.execute(
            sa.update(schema.saga_instances)
            .where(schema.saga_instances.c.id == sid)
            .values(data=sa.func.replace(schema.saga_instances.c.data, '"c"', "null"))
        )
    runtime.run_until_quiet(advance=5)
    assert instance(engine, sid).state == "COMPLETED"
    assert effects_of(engine, "o5")[-1] == "do c"


def test_compensation_that_keeps_failing_ends_failed_and_visible(world: Any) -> None:
    runtime, app, saga, engine = world
    sid = start(app, engine, saga, order="o6", reject_at="b", reject_undo=True)
    runtime.run_until_quiet(advance=5)
    found = instance(engine, sid)
    assert found.state == "FAILED"
    assert "compensation a" in (found.last_error or "") and "cannot undo" in (
        found.last_error or ""
    )
    assert found.attempt == 2 and found.deadline is None


def test_transient_participant_error_gives_up_with_a_failure_reply(world: Any) -> None:
    runtime, app, saga, engine = world
    sid = start(app, engine, saga, order="o7", transient_at="a")
    runtime.run_until_quiet()
    found = instance(engine, sid)
    assert found.state == "COMPENSATED"
    assert "gave up" in (found.last_error or "")
    assert effects_of(engine, "o7") == []  # every attempt rolled back


def test_duplicate_reply_changes_nothing_and_stale_reply_is_dead_lettered(world: Any) -> None:
    runtime, app, saga, engine = world
    sid = start(app, engine, saga, order="o8")
    runtime.relay_once()
    runtime.consume_once(lambda c: c.name != "orchestrator")  # alpha replies to step a
    runtime.relay_once()
    with engine.connect() as conn:
        reply = conn.execute(
            sa.select(schema.transport_messages.c.body).where(
                schema.transport_messages.c.channel == saga.reply_channel
            )
        ).scalar_one()
    runtime.transport.publish([_raw(saga.reply_channel, sid, reply)], 5)  # the same reply again
    runtime.run_until_quiet()
    assert instance(engine, sid).state == "COMPLETED"
    orchestrator = runtime.consumers[0]
    assert orchestrator.stats.duplicates == 1
    runtime.transport.publish(
        [_raw(saga.reply_channel, sid, reply.replace(b'"message_id":"', b'"message_id":"x'))], 5
    )
    runtime.run_until_quiet()
    with engine.connect() as conn:
        reasons = list(conn.scalars(sa.select(schema.dead_letters.c.reason)))
    assert any("COMPLETED" in r for r in reasons)
    assert effects_of(engine, "o8") == ["do a", "do l", "do b", "do c"]


def test_reply_for_unknown_saga_is_dead_lettered(world: Any) -> None:
    runtime, _app, saga, engine = world
    bogus = Envelope(
        message_type="Success",
        destination=saga.reply_channel,
        partition_key="nope",
        headers={
            "saga_type": "test_saga",
            "saga_id": "nope",
            "step": "a",
            "phase": "do",
            "command_id": "c",
            "outcome": "success",
        },
    )
    runtime.transport.publish([_raw(saga.reply_channel, "nope", bogus.to_wire())], 5)
    runtime.run_until_quiet()
    with engine.connect() as conn:
        reasons = list(conn.scalars(sa.select(schema.dead_letters.c.reason)))
    assert reasons == ["unknown saga id 'nope'"]


def test_concurrent_update_is_detected_by_the_version(world: Any) -> None:
    runtime, app, saga, engine = world
    sid = start(app, engine, saga, order="o9")
    with engine.begin() as conn:
        stale = store.load(conn, sid)
    assert stale is not None
    runtime.run_until_quiet()
    with engine.begin() as conn, pytest.raises(errors.ConcurrentUpdate):
        store.save(conn, stale, runtime.clock.now())


def test_a_start_writes_the_saga_and_its_first_command_together(world: Any) -> None:
    _, app, saga, engine = world
    sent: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *args: sent.append(args[2]))
    sid = start(app, engine, saga, order="o10")
    inserts = [sql for sql in sent if sql.lstrip().upper().startswith(("INSERT", "WITH"))]
    # PostgreSQL: the saga's row rides in the command's insert; elsewhere one insert each.
    assert len(inserts) == (1 if engine.dialect.name == "postgresql" else 2)
    with engine.connect() as conn:
        commands = conn.execute(
            sa.select(schema.outbox.c.headers).where(schema.outbox.c.aggregate_id == sid)
        ).all()
    assert len(commands) == 1
    sent_id = json.loads(commands[0].headers)["command_id"]
    started = instance(engine, sid)
    assert (started.state, started.command_id) == ("a", sent_id)
    assert started.created_at is not None and started.created_at == started.updated_at


def test_a_start_whose_saga_id_is_taken_writes_no_command(world: Any) -> None:
    _, app, saga, engine = world
    with engine.begin() as conn:
        app.start(conn, saga, Data(order="o11"), saga_id="taken")
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        app.start(conn, saga, Data(order="o12"), saga_id="taken")
    with engine.connect() as conn:
        orders = conn.scalars(
            sa.select(schema.outbox.c.payload).where(schema.outbox.c.aggregate_id == "taken")
        ).all()
    assert len(orders) == 1 and "o11" in orders[0]


def _raw(channel: str, key: str, body: bytes) -> Any:
    from saga_engine.transport.base import OutgoingMessage

    return OutgoingMessage(message_id="raw", destination=channel, partition_key=key, value=body)


def test_a_local_step_that_crashes_on_retry_fails_its_saga_not_the_worker(
    sqlite_url: str,
) -> None:
    from saga_engine.worker import Worker, WorkerOptions

    attempts: list[int] = []

    def flaky(data: Data, tx: Session) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise errors.Rejected("not yet")  # a business refusal: retried after a back-off
        raise RuntimeError("bug in the step")  # then a bug

    clock = ManualClock()
    saga: Saga[Data] = Saga(
        "crashy",
        data=Data,
        steps=[
            step("pay").local(lambda d, tx: None),
            step("notify").local(flaky).retriable(),
        ],
    )
    app = App("c", sagas=[saga], clock=clock)
    worker = Worker(app, WorkerOptions(db_url=sqlite_url, roles=["deadlines"]))
    try:
        with worker.main_engine.begin() as conn:
            sid = app.start(conn, saga, Data(order="o1"))
        clock.advance(60)
        worker.check_deadlines()  # must not raise
        found = instance(worker.main_engine, sid)
        assert found.state == "FAILED"
        assert "bug in the step" in (found.last_error or "")
    finally:
        worker.stop()


def test_the_deadline_index_holds_only_the_sagas_that_have_a_deadline(pg_url: str) -> None:
    """Every step rewrites its saga's row; most sagas have no deadline and ended ones never do. The
    index that ``store.due`` reads (several times a second in every worker) takes entries for the
    sagas that wait on a timer only, and the query can still use it."""
    engine = db.create_engine(pg_url)
    sent: list[tuple[str, Any]] = []
    now = ManualClock().now()
    try:
        with engine.begin() as conn:
            for i in range(5000):
                waiting = i % 500 == 0  # ten sagas wait on a timer, one of them past it
                deadline = now + timedelta(seconds=-1 if i == 0 else 60) if waiting else None
                saga = store.SagaInstance(
                    id=f"s{i}", saga_type="t", definition_version=1, state="a", data={}
                )
                saga.wait_until(deadline, "timeout" if waiting else None)
                store.insert(conn, saga, now)
            conn.exec_driver_sql("ANALYZE saga_instances")
            pages = conn.scalar(sa.text("SELECT pg_relation_size('ix_saga_instances_deadline')"))
        assert pages == 2 * 8192  # the metapage and one leaf; an entry for every saga took 7 pages
        sa.event.listen(engine, "before_cursor_execute", lambda *a: sent.append((a[2], a[3])))
        with engine.begin() as conn:
            assert store.due(conn, now, 100) == ["s0"]
            [(sql, params)] = sent
            [[plan]] = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) {sql}", params).all()
        scans = [n for n in plan_nodes(plan[0]["Plan"]) if "Scan" in n["Node Type"]]
        assert [n.get("Index Name") for n in scans] == ["ix_saga_instances_deadline"]
    finally:
        engine.dispose()


def plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from plan_nodes(child)
