"""Savepoints as the consumer's engine sends them (``db.fast_savepoints``).

Every handler runs in a savepoint, so its rejection undoes its own writes only. On PostgreSQL a
release waits for the next savepoint's round trip, or for the COMMIT: these tests hold that what
commits is the same as with a RELEASE sent at once, on every database, and that on PostgreSQL no
RELEASE costs a round trip of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy import Connection, Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from saga_engine import db


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
    engine = db.fast_savepoints(db.create_engine(db_url))
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
