"""A consumed batch applied as one unit, on each real database: the orchestrator reads the sagas of a
batch of replies with one statement and writes their states and commands with one executemany each;
a participant writes the replies to a batch of commands with one executemany. Statements are observed
with a ``before_cursor_execute`` listener, so each test checks both what was sent and what it did.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.orm import Session

from saga_engine import db, errors, schema, store
from saga_engine.app import App
from saga_engine.definition import Saga, step
from saga_engine.messages import Envelope, Message
from saga_engine.outbox.writer import OutboxWriter
from saga_engine.participant import Participant
from saga_engine.testing import ManualClock, Runtime

s = schema.saga_instances
effects = sa.Table(
    "test_batch_effects",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("saga", sa.String(64)),
    sa.Column("what", sa.String(64)),
)


class Data(BaseModel):
    order: str
    reject: bool = False
    bump: str | None = None  # the local step changes this order's saga behind the batch's back


class Reserve(Message):
    order: str
    reject: bool


class Reserved(Message):
    order: str


class Noticed(Message):
    """What the participant's handler publishes itself, in its own savepoint."""

    order: str


def build(clock: ManualClock, local_runs: list[str]) -> tuple[App, Saga[Data]]:
    stock = Participant("stock")
    writer = OutboxWriter(clock=clock)

    @stock.handles(Reserve)
    def reserve(cmd: Reserve, tx: Session) -> Reserved:
        tx.execute(effects.insert().values(saga=cmd.order, what="reserve"))
        notice = Noticed(order=cmd.order)
        writer.add(
            tx,
            Envelope(
                message_type=notice.message_type,
                destination="stock.events",
                partition_key=cmd.order,
                payload=notice.model_dump(mode="json"),
            ),
        )
        if cmd.reject:
            raise errors.Rejected("out of stock")  # takes back the row and the event above
        return Reserved(order=cmd.order)

    def note(data: Data, tx: Session) -> None:
        local_runs.append(data.order)
        tx.execute(effects.insert().values(saga=data.order, what="note"))
        if data.bump is not None:
            _bump_version(tx, data.bump)

    saga: Saga[Data] = Saga(
        "batchy",
        data=Data,
        steps=[
            step("reserve")
            .invoke("stock", lambda d: Reserve(order=d.order, reject=d.reject))
            .pivot(),
            step("note").local(note),
        ],
    )
    app = App("b", sagas=[saga], participants=[stock], metadata=[effects.metadata], clock=clock)
    return app, saga


def _bump_version(tx: Session, order: str) -> None:
    """Change the saga of ``order`` as another worker would: its version moves on."""
    tx.execute(
        sa.update(s).where(s.c.data.like(f'%"order":"{order}"%')).values(version=s.c.version + 1)
    )


class StatementLog:
    def __init__(self, engine: sa.Engine) -> None:
        self.sent: list[str] = []
        self.on = False
        sa.event.listen(engine, "before_cursor_execute", self._record)

    def _record(self, _conn: Any, _cursor: Any, sql: str, *_: Any) -> None:
        if self.on:
            self.sent.append(" ".join(sql.split()))

    def count(self, prefix: str) -> int:
        return sum(1 for sql in self.sent if sql.startswith(prefix))


@pytest.fixture
def world(db_url: str) -> Iterator[tuple[Runtime, App, Saga[Data], sa.Engine, list[str]]]:
    clock = ManualClock()
    local_runs: list[str] = []
    app, saga = build(clock, local_runs)
    engine = db.create_engine(db_url)
    app.create_tables(engine)
    runtime = Runtime(app, engine, clock=clock)
    yield runtime, app, saga, engine, local_runs
    runtime.close()
    engine.dispose()


def start_all(app: App, engine: sa.Engine, saga: Saga[Data], *data: Data) -> list[str]:
    with engine.begin() as conn:
        return [app.start(conn, saga, d) for d in data]


def states(engine: sa.Engine, ids: list[str]) -> list[str]:
    with engine.connect() as conn:
        found = store.load_many(conn, ids)
    return [found[i].state if i in found else "missing" for i in ids]


def effects_by_saga(engine: sa.Engine) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    with engine.connect() as conn:
        for saga, what in conn.execute(sa.select(effects.c.saga, effects.c.what).order_by("id")):
            out.setdefault(saga, []).append(what)
    return out


def replies_queued(runtime: Runtime, saga: Saga[Data], engine: sa.Engine) -> None:
    """Relay the commands, let the participant answer them all, relay the replies."""
    runtime.relay_once()
    runtime.consume_once(lambda c: c.name != "orchestrator")
    runtime.relay_once()
    with engine.connect() as conn:
        queued = conn.scalar(
            sa.select(sa.func.count())
            .select_from(schema.transport_messages)
            .where(schema.transport_messages.c.channel == saga.reply_channel)
        )
    assert queued, "the replies should wait for the orchestrator"


def test_a_batch_of_replies_reads_its_sagas_once_and_writes_them_once(world: Any) -> None:
    runtime, app, saga, engine, local_runs = world
    orders = [f"o{n}" for n in range(5)]
    ids = start_all(app, engine, saga, *(Data(order=o) for o in orders))
    replies_queued(runtime, saga, engine)
    log = StatementLog(engine)
    log.on = True
    assert runtime.consume_once(lambda c: c.name == "orchestrator") == 5
    log.on = False
    assert log.count("SELECT saga_instances.id") == 1
    assert log.count("UPDATE saga_instances") == 1
    assert states(engine, ids) == ["COMPLETED"] * 5
    assert sorted(local_runs) == orders
    assert effects_by_saga(engine) == {o: ["reserve", "note"] for o in orders}


def test_a_saga_changed_during_a_batch_sends_the_batch_back_one_reply_at_a_time(
    world: Any,
) -> None:
    """The batch's version check fails as a whole; re-applied one by one, every reply lands once."""
    runtime, app, saga, engine, local_runs = world
    data = [Data(order="victim"), Data(order="bumper", bump="victim"), Data(order="bystander")]
    ids = start_all(app, engine, saga, *data)
    replies_queued(runtime, saga, engine)
    runtime.consume_once(lambda c: c.name == "orchestrator")
    # The batch ran every local step, failed on the victim's version, and rolled back; then each
    # reply ran alone and committed. The local steps of the first run left nothing behind.
    assert sorted(local_runs) == sorted(["victim", "bumper", "bystander"] * 2)
    runtime.run_until_quiet()
    assert states(engine, ids) == ["COMPLETED"] * 3
    assert effects_by_saga(engine) == {
        o: ["reserve", "note"] for o in ("victim", "bumper", "bystander")
    }


def test_a_participant_writes_a_batchs_replies_with_one_insert_and_a_rejection_takes_back_its_own(
    world: Any,
) -> None:
    runtime, app, saga, engine, _ = world
    ids = start_all(
        app, engine, saga, Data(order="a"), Data(order="b", reject=True), Data(order="c")
    )
    runtime.relay_once()
    log = StatementLog(engine)
    log.on = True
    assert runtime.consume_once(lambda c: c.name != "orchestrator") == 3
    log.on = False
    # Three events the handler added itself (each at once, in its savepoint), one for the replies.
    assert log.count("INSERT INTO outbox_messages") == 4
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                schema.outbox.c.message_type, schema.outbox.c.partition_key, schema.outbox.c.headers
            )
            .where(schema.outbox.c.message_type != "Reserve")
            .order_by(schema.outbox.c.id)
        ).all()
    events = [key for kind, key, _ in rows if kind == "Noticed"]
    assert events == ["a", "c"]  # b's was rolled back with its savepoint
    replies = [
        (kind, key, '"outcome":"failure"' in headers)
        for kind, key, headers in rows
        if kind != "Noticed"
    ]
    assert replies == [
        ("Reserved", ids[0], False),
        ("Failure", ids[1], True),
        ("Reserved", ids[2], False),
    ]
    # The replies come after the events of the same batch: written when the batch closed.
    assert [kind for kind, _, _ in rows][-3:] == ["Reserved", "Failure", "Reserved"]
    runtime.run_until_quiet()
    assert effects_by_saga(engine) == {"a": ["reserve", "note"], "c": ["reserve", "note"]}


def test_save_many_refuses_the_whole_batch_when_one_saga_moved_on(world: Any) -> None:
    runtime, app, saga, engine, _ = world
    ids = start_all(app, engine, saga, Data(order="x"), Data(order="y"))
    with engine.connect() as conn:
        read = store.load_many(conn, ids)
    with engine.begin() as conn:  # another worker moves y on
        conn.execute(sa.update(s).where(s.c.id == ids[1]).values(version=s.c.version + 1))
    for instance in read.values():
        instance.state = "moved"
    with engine.connect() as conn:
        with pytest.raises(errors.ConcurrentUpdate, match="1 of 2 sagas"):
            store.save_many(conn, [(read[i], read[i].version) for i in ids], runtime.clock.now())
        conn.rollback()
    assert states(engine, ids) == ["reserve", "reserve"]
