"""Several rows as one statement of arrays (``db.ArrayRows``) write what an executemany writes."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest
import sqlalchemy as sa

from saga_engine import db, schema
from saga_engine.messages import Envelope
from saga_engine.outbox import OutboxWriter
from saga_engine.testing.runtime import ManualClock

metadata = sa.MetaData()
items = sa.Table(
    "test_array_items",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(8), nullable=False),
    sa.Column("note", sa.Text),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("seen_at", schema.Timestamp),  # microseconds on MariaDB too
)
KEYS = ("id", "name", "note", "version", "seen_at")
INSERT = db.DriverStatement(items.insert(), KEYS, arrays=db.ArrayRows.insert(items, KEYS))
UPDATE_KEYS = ("name", "note", "version", "seen_at", "b_id", "b_version")
UPDATE = db.DriverStatement(
    sa.update(items).where(
        items.c.id == sa.bindparam("b_id"), items.c.version == sa.bindparam("b_version")
    ),
    UPDATE_KEYS,
    arrays=db.ArrayRows.update(items, UPDATE_KEYS, where={"id": "b_id", "version": "b_version"}),
)
AT = datetime(2030, 1, 2, 3, 4, 5, 678901)


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = db.create_engine(db_url)
    metadata.create_all(engine)
    yield engine
    engine.dispose()


def executions(engine: sa.Engine) -> list[tuple[str, bool]]:
    """Every statement the engine sends from now on, and whether it went as an executemany."""
    seen: list[tuple[str, bool]] = []

    def record(
        conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        seen.append((statement, many))

    sa.event.listen(engine, "before_cursor_execute", record)
    return seen


def test_rows_are_inserted_as_given_and_on_postgresql_in_one_statement(engine: sa.Engine) -> None:
    rows = [
        {"id": 3, "name": "été", "note": None, "version": 0, "seen_at": AT},
        {"id": 1, "name": "b", "note": '{"x": [1, "\\u00e9"]}', "version": 7, "seen_at": None},
        {"id": 2, "name": "c" * 8, "note": "", "version": 2**31 - 1, "seen_at": AT},
    ]
    sent = executions(engine)
    with engine.begin() as conn:
        INSERT.execute(conn, rows)
    with engine.connect() as conn:
        stored = [row._asdict() for row in conn.execute(sa.select(items).order_by(items.c.id))]
    assert stored == sorted(rows, key=lambda row: row["id"])
    inserts = [many for statement, many in sent if statement.startswith("INSERT")]
    # One statement of arrays on PostgreSQL; an executemany on the others.
    assert inserts == ([False] if engine.dialect.name == "postgresql" else [True])


def test_an_update_of_many_rows_counts_the_rows_whose_version_matched(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        INSERT.execute(
            conn,
            [
                {"id": i, "name": f"n{i}", "note": None, "version": 1, "seen_at": None}
                for i in (1, 2, 3)
            ],
        )
    changes = [
        {"name": "one", "note": "x", "version": 2, "seen_at": AT, "b_id": 1, "b_version": 1},
        {"name": "two", "note": None, "version": 2, "seen_at": None, "b_id": 2, "b_version": 0},
        {"name": "three", "note": "z", "version": 2, "seen_at": AT, "b_id": 3, "b_version": 1},
    ]
    with engine.begin() as conn:
        assert UPDATE.execute(conn, changes).rowcount == 2  # row 2 was at version 1, not 0
    with engine.connect() as conn:
        stored = conn.execute(sa.select(items.c.name, items.c.version).order_by(items.c.id)).all()
    assert [tuple(row) for row in stored] == [("one", 2), ("n2", 1), ("three", 2)]


@pytest.mark.postgres
def test_a_value_too_long_for_its_column_is_refused_not_cut_short(pg_url: str) -> None:
    """The arrays are ``text[]``: a cast to ``varchar(8)[]`` would cut a longer name silently."""
    engine = db.create_engine(pg_url)
    try:
        metadata.create_all(engine)
        rows = [
            {"id": i, "name": "n" * (7 + i), "note": None, "version": 0, "seen_at": None}
            for i in (1, 2)
        ]
        with pytest.raises(sa.exc.DataError, match="too long"), engine.begin() as conn:
            INSERT.execute(conn, rows)
        with engine.connect() as conn:
            assert conn.scalar(sa.select(sa.func.count()).select_from(items)) == 0
    finally:
        engine.dispose()


def test_a_batch_of_messages_is_written_as_each_one_alone_would_be(
    db_url: str, engines: list[object]
) -> None:
    engine = db.create_engine(db_url)
    engines.append(engine)
    writer = OutboxWriter(clock=ManualClock())

    def batch(tag: str) -> list[Envelope]:
        return [
            Envelope(
                message_id=f"{tag}-{i}",
                message_type="OrderPlaced",
                destination="orders.events",
                partition_key=f"order-{i % 2}",
                aggregate_type="order",
                aggregate_id=f"order-{i % 2}",
                correlation_id=None if i % 2 else f"c-{i}",
                headers={"saga_id": f"s-{i}"} if i else {},
                payload={"n": i, "text": "grüße" if i == 1 else "plain"},
            )
            for i in range(4)
        ]

    with engine.begin() as conn:
        writer.add_many(conn, batch("many"))
    with engine.begin() as conn:
        for envelope in batch("alone"):
            writer.add(conn, envelope)
    o = schema.outbox
    with engine.connect() as conn:
        rows = conn.execute(sa.select(o).order_by(o.c.id)).all()
    many, alone = rows[:4], rows[4:]
    assert [row.message_id for row in many] == [f"many-{i}" for i in range(4)]  # ids in order
    assert [row.message_id for row in alone] == [f"alone-{i}" for i in range(4)]

    def written(row: Any) -> dict[str, Any]:
        return {k: v for k, v in row._asdict().items() if k not in ("id", "message_id")}

    assert [written(row) for row in many] == [written(row) for row in alone]
