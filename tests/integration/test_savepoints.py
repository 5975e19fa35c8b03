"""Savepoints as ``db.create_engine``'s engines send them (``db.fast_savepoints``).

Every handler, and every local step (those at a saga's start run inside ``app.start``, in the
caller's transaction), runs in a savepoint, so its rejection undoes its own writes only. On PostgreSQL a
release waits for the next savepoint's round trip, or for the COMMIT: these tests hold that what
commits is the same as with a RELEASE sent at once, on every database, and that on PostgreSQL no
RELEASE costs a round trip of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from saga_engine import db, errors, schema
from saga_engine.app import App
from saga_engine.definition import Saga, step
from saga_engine.messages import Message
from saga_engine.participant import Participant


class Boom(Exception):
    pass


class Base(DeclarativeBase):
    pass


class Note(Base):
    """What a handler writes through its Session, as the ORM's users do."""

    __tablename__ = "savepoint_notes"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    text: Mapped[str] = mapped_column(sa.String(8))


@pytest.fixture
def engine(db_url: str, engines: list[object]) -> Iterator[Engine]:
    engine = db.create_engine(db_url)
    engines.append(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE savepoint_rows (v VARCHAR(8))")
    Base.metadata.create_all(engine)
    yield engine


def insert(conn: Connection, value: str) -> None:
    conn.execute(sa.text("INSERT INTO savepoint_rows (v) VALUES (:v)"), {"v": value})


def rows(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.scalars(sa.text("SELECT v FROM savepoint_rows")))


def statements(engine: Engine) -> list[str]:
    sent: list[str] = []
    sa.event.listen(engine, "before_cursor_execute", lambda *args: sent.append(args[2]))
    return sent


def test_released_savepoints_commit_and_rolled_back_ones_do_not(engine: Engine) -> None:
    with engine.begin() as conn:
        with conn.begin_nested():
            insert(conn, "a")
        with pytest.raises(Boom), conn.begin_nested():
            insert(conn, "b")
            raise Boom
        with conn.begin_nested():
            insert(conn, "c")
            with conn.begin_nested():
                insert(conn, "d")  # released inside c, then c rolls back to a later savepoint
            with pytest.raises(Boom), conn.begin_nested():
                insert(conn, "e")
                with conn.begin_nested():
                    insert(conn, "f")
                raise Boom
        insert(conn, "g")  # after the last release, in the transaction itself
    assert rows(engine) == ["a", "c", "d", "g"]


def test_a_rollback_to_an_outer_savepoint_undoes_a_released_inner_one(engine: Engine) -> None:
    with engine.begin() as conn:
        with pytest.raises(Boom), conn.begin_nested():
            with conn.begin_nested():
                insert(conn, "inner")
            insert(conn, "outer")
            raise Boom
        insert(conn, "after")
    assert rows(engine) == ["after"]


def test_a_transaction_rolled_back_keeps_nothing_and_the_next_one_starts_clean(
    engine: Engine,
) -> None:
    with engine.connect() as conn:
        with conn.begin() as transaction:
            with conn.begin_nested():
                insert(conn, "lost")
            transaction.rollback()
        # The same connection: the release left over must not be sent here.
        with conn.begin(), conn.begin_nested():
            insert(conn, "kept")
    assert rows(engine) == ["kept"]


@pytest.mark.parametrize(
    "db_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_on_postgresql_a_release_shares_the_next_savepoints_round_trip(engine: Engine) -> None:
    sent = statements(engine)
    with engine.begin() as conn:
        for value in ("a", "b", "c"):
            with conn.begin_nested():
                insert(conn, value)
    with engine.begin() as conn, conn.begin_nested():
        insert(conn, "d")
    savepoints = [s for s in sent if "SAVEPOINT" in s]
    assert savepoints == [
        "SAVEPOINT sa_savepoint_1",
        "RELEASE SAVEPOINT sa_savepoint_1; SAVEPOINT sa_savepoint_2",
        "RELEASE SAVEPOINT sa_savepoint_2; SAVEPOINT sa_savepoint_3",
        "SAVEPOINT sa_savepoint_1",  # the last one of each transaction went with its COMMIT
    ]
    assert rows(engine) == ["a", "b", "c", "d"]


def notes(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.scalars(sa.select(Note.text)))


def test_a_handlers_session_flushes_its_objects_into_the_savepoint(engine: Engine) -> None:
    with engine.begin() as conn:
        with db.session_in_savepoint(conn) as session:
            session.add(Note(id=1, text="kept"))  # never flushed by the handler itself
        with pytest.raises(Boom), db.session_in_savepoint(conn) as session:
            session.add(Note(id=2, text="raised"))
            session.flush()
            raise Boom
        with db.session_in_savepoint(conn) as session:
            session.add(Note(id=3, text="undone"))
            session.flush()
            session.rollback()  # the handler's own rollback: its savepoint, not the batch
            session.add(Note(id=4, text="after"))
        insert(conn, "batch")
    assert notes(engine) == ["after", "kept"]
    assert rows(engine) == ["batch"]


def test_after_a_handlers_own_rollback_its_next_writes_are_undone_alone(engine: Engine) -> None:
    with engine.begin() as conn:
        insert(conn, "before")
        with pytest.raises(Boom), db.session_in_savepoint(conn) as session:
            session.add(Note(id=1, text="undone"))
            session.flush()
            session.rollback()
            session.add(Note(id=2, text="again"))
            session.flush()  # in a savepoint of its own, not in the caller's transaction
            raise Boom
        insert(conn, "after")
    assert notes(engine) == []
    assert rows(engine) == ["after", "before"]


def test_a_session_that_never_reaches_the_database_takes_no_savepoint(engine: Engine) -> None:
    sent = statements(engine)
    with engine.begin() as conn:
        with db.session_in_savepoint(conn) as session:
            session.info["seen"] = True  # used, but never for the database
        with pytest.raises(errors.Rejected), db.session_in_savepoint(conn):
            raise errors.Rejected("before any write")  # nothing to undo
        with db.session_in_savepoint(conn) as session:
            session.add(Note(id=1, text="flushed"))  # reaches it at the block's flush
        insert(conn, "batch")
    assert [s for s in sent if "SAVEPOINT" in s] == ["SAVEPOINT sa_savepoint_1"] + (
        [] if engine.dialect.name == "postgresql" else ["RELEASE SAVEPOINT sa_savepoint_1"]
    )
    assert notes(engine) == ["flushed"]
    assert rows(engine) == ["batch"]


class Order(BaseModel):
    order_id: str
    reject: bool = False


class Ship(Message):
    order_id: str


def write_note(data: Order, tx: Session) -> None:
    """A leading local step that writes through its Session, then may reject."""
    tx.add(Note(id=int(data.order_id), text="step"))
    tx.flush()
    if data.reject:
        raise errors.Rejected("no")


shipping = Participant("savepoint_shipping")
started: Saga[Order] = Saga(
    "savepoint_started",
    data=Order,
    steps=[
        step("note").local(write_note).compensate(lambda data, tx: None),
        step("ship").invoke("savepoint_shipping", lambda d: Ship(order_id=d.order_id)),
    ],
)
quiet: Saga[Order] = Saga(
    "savepoint_quiet",
    data=Order,
    steps=[
        step("approve").local(lambda data, tx: None).compensate(lambda data, tx: None),
        step("ship").invoke("savepoint_shipping", lambda d: Ship(order_id=d.order_id)),
    ],
)
app = App("savepoints", sagas=[started, quiet], participants=[shipping])


def state_of(engine: Engine, saga_id: str) -> str | None:
    with engine.connect() as conn:
        s = schema.saga_instances
        return conn.scalar(sa.select(s.c.state).where(s.c.id == saga_id))


@pytest.fixture
def app_engine(engine: Engine) -> Engine:
    """The engine with the app's tables: what ``app.start`` runs on in a service."""
    app.create_tables(engine)
    return engine


def test_app_start_runs_a_leading_local_step_in_a_savepoint_of_the_callers_transaction(
    app_engine: Engine,
) -> None:
    engine, sent = app_engine, statements(app_engine)
    with Session(engine) as session, session.begin():
        kept = app.start(session, started, Order(order_id="1"))
        undone = app.start(session, started, Order(order_id="2", reject=True))
        session.add(Note(id=3, text="caller"))
    assert notes(engine) == ["caller", "step"]  # the rejected step's note went with its savepoint
    assert (state_of(engine, kept), state_of(engine, undone)) == ("ship", "COMPENSATED")
    if engine.dialect.name == "postgresql":  # one round trip per savepoint, none per release
        savepoints = [s for s in sent if "SAVEPOINT" in s]
        assert savepoints == [
            "SAVEPOINT sa_savepoint_1",
            "RELEASE SAVEPOINT sa_savepoint_1; SAVEPOINT sa_savepoint_2",
            "ROLLBACK TO SAVEPOINT sa_savepoint_2",
        ]


def test_app_start_takes_no_savepoint_for_a_leading_step_that_writes_nothing(
    app_engine: Engine,
) -> None:
    sent = statements(app_engine)
    with Session(app_engine) as session, session.begin():
        saga_id = app.start(session, quiet, Order(order_id="1"))
    assert state_of(app_engine, saga_id) == "ship"
    assert [s for s in sent if "SAVEPOINT" in s] == []
