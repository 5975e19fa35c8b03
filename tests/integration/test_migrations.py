"""The packaged Alembic migrations, on SQLite, PostgreSQL and MariaDB.

The central test: upgrading an empty database produces exactly ``schema.metadata`` (Alembic's
autogenerate comparison finds nothing to do), so the tables the engine queries and the tables users
create with ``saga-engine db upgrade`` cannot drift apart.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from saga_engine import db, errors, migrate, schema
from saga_engine.messages import Envelope
from saga_engine.outbox import OutboxWriter
from tests.conftest import unavailable
from tests.support import databases

ROOT = Path(__file__).resolve().parents[2]
KINDS = [
    pytest.param("sqlite", marks=pytest.mark.sqlite),
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mariadb", marks=pytest.mark.mariadb),
]


def empty_database(kind: str, tmp_path: Path) -> Iterator[str]:
    reason = databases.server_error(kind)
    if reason:
        unavailable(reason)
    with databases.fresh_database(kind, tmp_path, create_schema=False) as url:
        yield url


@pytest.fixture(params=KINDS)
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database with no tables at all, on each of the three databases."""
    yield from empty_database(request.param, tmp_path)


@pytest.fixture
def empty_pg_url(tmp_path: Path) -> Iterator[str]:
    yield from empty_database("postgres", tmp_path)


@pytest.fixture
def empty_mariadb_url(tmp_path: Path) -> Iterator[str]:
    yield from empty_database("mariadb", tmp_path)


@pytest.fixture
def engine_of(engines: list[object]) -> Any:
    def make(url: str) -> sa.Engine:
        engine = db.create_engine(url)
        engines.append(engine)
        return engine

    return make


def differences(engine: sa.Engine) -> list[Any]:
    """What Alembic would have to change to turn the database into ``schema.metadata``."""
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts=migrate.context_options(conn.dialect.name))
        return list(compare_metadata(context, schema.metadata))


def table_names(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names())


def write_message(engine: sa.Engine, key: str = "order-1") -> None:
    envelope = Envelope(message_type="OrderCreated", destination="orders", partition_key=key)
    with engine.begin() as conn:
        OutboxWriter().add(conn, envelope)


# -- the schema equals the migrations -------------------------------------------------------------


def test_upgrade_of_an_empty_database_creates_exactly_the_schema(
    empty_url: str, engine_of: Any
) -> None:
    assert migrate.current(empty_url) is None

    assert migrate.upgrade(empty_url) == migrate.head()

    engine = engine_of(empty_url)
    assert table_names(engine) == {*schema.metadata.tables, migrate.VERSION_TABLE}
    assert differences(engine) == []
    assert migrate.current(empty_url) == migrate.head()


def test_the_comparison_sees_a_missing_index(empty_url: str, engine_of: Any) -> None:
    """Guards the test above against comparing nothing."""
    migrate.upgrade(empty_url)
    engine = engine_of(empty_url)
    index = next(i for i in schema.outbox.indexes if i.name == "ix_outbox_messages_status_id")
    with engine.begin() as conn:
        index.drop(conn)

    assert [diff[0] for diff in differences(engine)] == ["add_index"]


@pytest.mark.mariadb
def test_the_comparison_sees_a_narrower_payload_type(
    empty_mariadb_url: str, engine_of: Any
) -> None:
    migrate.upgrade(empty_mariadb_url)
    engine = engine_of(empty_mariadb_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE outbox_messages MODIFY payload TEXT NOT NULL")

    assert [diff[0][0] for diff in differences(engine)] == ["modify_type"]


def test_upgrading_again_is_a_noop(empty_url: str, engine_of: Any) -> None:
    migrate.upgrade(empty_url)
    engine = engine_of(empty_url)
    write_message(engine)

    assert migrate.upgrade(empty_url) == migrate.head()
    assert migrate.upgrade(empty_url, "head") == migrate.head()

    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(schema.outbox)) == 1
    assert differences(engine) == []


def test_concurrent_upgrades_take_turns(empty_url: str, engine_of: Any) -> None:
    """Workers that all run ``db upgrade`` at start-up must not trip over each other."""
    results: list[object] = []

    def run() -> None:
        try:
            results.append(migrate.upgrade(empty_url))
        except Exception as error:  # reported by the assertion below
            results.append(error)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert results == [migrate.head()] * 3
    assert differences(engine_of(empty_url)) == []


def test_mariadb_upgrades_of_other_databases_do_not_wait(
    empty_mariadb_url: str, engine_of: Any
) -> None:
    """``GET_LOCK`` names are global to a server: the lock must name the database it guards."""
    other = migrate.mysql_lock_name("some_other_database")
    with engine_of(empty_mariadb_url).connect() as holder:
        assert holder.scalar(sa.text("SELECT GET_LOCK(:n, 0)"), {"n": other}) == 1
        try:
            assert migrate.upgrade(empty_mariadb_url) == migrate.head()
        finally:
            holder.scalar(sa.text("SELECT RELEASE_LOCK(:n)"), {"n": other})


def test_downgrade_to_base_removes_everything_and_upgrade_restores_it(
    empty_url: str, engine_of: Any
) -> None:
    migrate.upgrade(empty_url)

    assert migrate.downgrade(empty_url, "base") is None
    engine = engine_of(empty_url)
    assert table_names(engine) == {migrate.VERSION_TABLE}

    migrate.upgrade(empty_url)
    assert differences(engine) == []


def test_revisions_step_one_at_a_time(empty_url: str, engine_of: Any) -> None:
    assert migrate.upgrade(empty_url, "0001") == "0001"
    assert "outbox_messages" in table_names(engine_of(empty_url))
    assert migrate.upgrade(empty_url) == migrate.head()


def test_a_database_made_by_create_all_is_adopted_at_head(empty_url: str, engine_of: Any) -> None:
    """Demos and tests create the tables with ``metadata.create_all``; upgrading them just works."""
    engine = engine_of(empty_url)
    schema.metadata.create_all(engine)
    write_message(engine)

    assert migrate.upgrade(empty_url) == migrate.head()

    assert migrate.current(empty_url) == migrate.head()
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(schema.outbox)) == 1


@pytest.mark.sqlite
def test_an_unversioned_database_that_differs_is_refused_until_stamped(
    tmp_path: Path, engine_of: Any
) -> None:
    with databases.fresh_database("sqlite", tmp_path, create_schema=True) as url:
        engine = engine_of(url)
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP INDEX ix_outbox_messages_status_id")

        with pytest.raises(errors.ConfigurationError, match="differ from this version's schema"):
            migrate.upgrade(url)
        assert migrate.current(url) is None

        migrate.stamp(url, "head")  # the operator's decision, after checking the schema
        assert migrate.upgrade(url) == migrate.head()


def test_the_application_tables_are_left_alone(empty_url: str, engine_of: Any) -> None:
    """The engine shares the database with the application and its own Alembic history."""
    engine = engine_of(empty_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO alembic_version VALUES ('app_0042')")
        conn.exec_driver_sql("CREATE TABLE orders (id VARCHAR(36) PRIMARY KEY)")

    migrate.upgrade(empty_url)

    assert differences(engine) == []  # not even a proposal to drop the application's tables
    migrate.downgrade(empty_url, "base")
    assert table_names(engine) == {"alembic_version", "orders", migrate.VERSION_TABLE}
    with engine.connect() as conn:
        assert (
            conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == "app_0042"
        )


# -- PostgreSQL wake-up triggers ------------------------------------------------------------------


def trigger_definitions(engine: sa.Engine) -> dict[str, tuple[str, str]]:
    """Trigger name -> (CREATE TRIGGER statement, function source) of the public schema."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT t.tgname, pg_get_triggerdef(t.oid), pg_get_functiondef(t.tgfoid)"
                " FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
                " WHERE NOT t.tgisinternal ORDER BY t.tgname"
            )
        ).all()
    return {name: (trigger, function) for name, trigger, function in rows}


@pytest.mark.postgres
def test_postgres_notify_triggers_equal_those_of_the_schema(
    empty_pg_url: str, tmp_path: Path, engine_of: Any
) -> None:
    migrate.upgrade(empty_pg_url)
    migrated = trigger_definitions(engine_of(empty_pg_url))

    assert set(migrated) == {f"{table}_notify" for table in schema.POSTGRES_TRIGGERS}
    with databases.fresh_database("postgres", tmp_path, create_schema=True) as created_url:
        assert migrated == trigger_definitions(engine_of(created_url))


@pytest.mark.postgres
def test_postgres_indexes_equal_those_of_the_schema(
    empty_pg_url: str, tmp_path: Path, engine_of: Any
) -> None:
    """Index by index, with the ``WHERE`` of the partial ones, which Alembic's comparison above
    does not look at."""
    migrate.upgrade(empty_pg_url)
    migrated = index_definitions(engine_of(empty_pg_url))

    assert "ix_saga_instances_deadline" in migrated
    assert migrated["ix_saga_instances_deadline"].endswith("WHERE (deadline IS NOT NULL)")
    with databases.fresh_database("postgres", tmp_path, create_schema=True) as created_url:
        created = index_definitions(engine_of(created_url))
    created.pop(f"{migrate.VERSION_TABLE}_pkc", None)  # the version table is the migrations' own
    migrated.pop(f"{migrate.VERSION_TABLE}_pkc")
    assert migrated == created


def index_definitions(engine: sa.Engine) -> dict[str, str]:
    """Index name -> its ``CREATE INDEX`` statement, for the public schema."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public'")
        ).all()
    return {name: definition for name, definition in rows}


@pytest.mark.postgres
def test_postgres_trigger_notifies_on_insert(empty_pg_url: str, engine_of: Any) -> None:
    import psycopg

    migrate.upgrade(empty_pg_url)
    conninfo = sa.make_url(empty_pg_url).set(drivername="postgresql")
    with psycopg.connect(conninfo.render_as_string(hide_password=False), autocommit=True) as conn:
        conn.execute('LISTEN "saga_engine_outbox"')
        write_message(engine_of(empty_pg_url))
        channels = [n.channel for n in conn.notifies(timeout=5, stop_after=1)]

    assert channels == ["saga_engine_outbox"]


@pytest.mark.postgres
def test_downgrade_to_0008_makes_every_outbox_insert_notify_again(
    empty_pg_url: str, engine_of: Any
) -> None:
    """0009 makes the outbox's NOTIFY fall silent while a relay holds the mute; below it the
    trigger notifies whatever the locks say."""
    migrate.upgrade(empty_pg_url)
    assert "pg_try_advisory_lock_shared" in outbox_trigger_source(engine_of(empty_pg_url))
    migrate.downgrade(empty_pg_url, "0008")

    source = outbox_trigger_source(engine_of(empty_pg_url))
    assert "advisory" not in source
    assert "pg_notify('saga_engine_outbox', '')" in source


def outbox_trigger_source(engine: sa.Engine) -> str:
    return trigger_definitions(engine)["outbox_messages_notify"][1]


@pytest.mark.postgres
def test_downgrade_drops_the_trigger_functions(empty_pg_url: str, engine_of: Any) -> None:
    migrate.upgrade(empty_pg_url)
    migrate.downgrade(empty_pg_url, "base")

    with engine_of(empty_pg_url).connect() as conn:
        functions = conn.scalars(
            sa.text("SELECT proname FROM pg_proc WHERE proname IN :names").bindparams(
                sa.bindparam(
                    "names", [f"{t}_notify" for t in schema.POSTGRES_TRIGGERS], expanding=True
                )
            )
        ).all()
    assert functions == []


# -- statuses -------------------------------------------------------------------------------------


def test_outbox_status_default_is_pending(empty_url: str, engine_of: Any) -> None:
    """A row inserted without a status gets the migration's server default: PENDING."""
    migrate.upgrade(empty_url)
    engine = engine_of(empty_url)
    t = schema.outbox
    now = sa.func.current_timestamp()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(t).values(
                message_id="m-1",
                message_type="T",
                destination="d",
                partition_key="k",
                payload="{}",
                headers="{}",  # TEXT has no server default (MySQL refuses one)
                next_retry_at=now,
                created_at=now,
                updated_at=now,
            )
        )
        row = conn.execute(sa.select(t.c.status, t.c.retry_count)).one()

    assert row.status == schema.OutboxStatus.PENDING == 0
    assert row.retry_count == 0


def test_outbox_statuses_are_those_the_docs_list() -> None:
    """docs/outbox.md has a table ``| 0 | `PENDING` | ...`` of every status, and no other."""
    text = (ROOT / "docs" / "outbox.md").read_text(encoding="utf-8")
    documented = {
        name: int(value) for value, name in re.findall(r"^\| (\d) \| `([A-Z]+)` \|", text, re.M)
    }

    assert documented == {status.name: status.value for status in schema.OutboxStatus}


def test_the_first_revision_writes_pending_as_status_default() -> None:
    path = next((ROOT / "saga_engine" / "migrations" / "versions").glob("0001_*.py"))
    spec = importlib.util.spec_from_file_location("revision_0001", path)
    assert spec is not None and spec.loader is not None
    revision = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(revision)

    (status,) = [c for c in revision._message_columns() if c.name == "status"]
    assert status.server_default.arg == str(schema.OutboxStatus.PENDING.value)


# -- errors, offline SQL, the revision helper -----------------------------------------------------


def test_unreachable_database_raises_without_the_password() -> None:
    with pytest.raises(errors.DatabaseUnavailable) as raised:
        migrate.upgrade("postgresql+psycopg://u:s3cret@127.0.0.1:1/x")

    assert "s3cret" not in str(raised.value)
    assert "127.0.0.1" in str(raised.value)


@pytest.mark.parametrize("url", ["bogus://x", "not a url"])
def test_bad_urls_raise_configuration_errors(url: str) -> None:
    with pytest.raises(errors.ConfigurationError):
        migrate.upgrade(url)


def test_offline_sql_for_postgres_has_tables_triggers_and_version_table() -> None:
    ddl = migrate.sql("postgresql+psycopg://u:s3cret@db.invalid/x")

    assert "CREATE TABLE saga_engine_alembic_version" in ddl
    assert "CREATE TABLE outbox_messages" in ddl
    assert "CREATE TRIGGER outbox_messages_notify" in ddl
    assert "s3cret" not in ddl


@pytest.mark.sqlite
def test_revision_helper_writes_the_next_numbered_revision(tmp_path: Path) -> None:
    """``python -m saga_engine.migrate revision -m ...`` as maintainers run it (on a copy)."""
    scripts = tmp_path / "migrations"
    shutil.copytree(
        ROOT / "saga_engine" / "migrations", scripts, ignore=shutil.ignore_patterns("__pycache__")
    )
    extra = sa.Table(
        "test_extra_table",
        schema.metadata,
        sa.Column("id", schema.BigId, primary_key=True),
        sa.Column("at", schema.Timestamp, nullable=False),
    )
    try:
        path = migrate.revision("extra table", script_location=str(scripts))
        expected = f"{int(str(migrate.head())) + 1:04d}"

        assert path.name == f"{expected}_extra_table.py"
        source = path.read_text()
        assert "op.create_table" in source
        assert not re.search(r"^(from|import) saga_engine", source, re.M)
        with databases.fresh_database("sqlite", tmp_path, create_schema=False) as url:
            assert migrate.upgrade(url, script_location=str(scripts)) == expected
            engine = db.create_engine(url)
            try:
                assert differences(engine) == []
            finally:
                engine.dispose()
    finally:
        schema.metadata.remove(extra)


# -- the PostgreSQL partitioning recipe of docs/outbox.md ----------------------------------------


def docs_sql_blocks() -> list[str]:
    text = (ROOT / "docs" / "outbox.md").read_text(encoding="utf-8")
    section = text[text.index("### Partitions on PostgreSQL") : text.index("## Monitoring")]
    return re.findall(r"```sql\n(.*?)```", section, re.S)


@pytest.mark.postgres
def test_the_partitioning_recipe_of_the_docs_works(empty_pg_url: str, engine_of: Any) -> None:
    import psycopg

    from saga_engine.outbox.relay import Relay, RelayConfig
    from saga_engine.transport.sql import SqlTransport

    convert, drop_day = docs_sql_blocks()
    migrate.upgrade(empty_pg_url)
    engine = engine_of(empty_pg_url)
    write_message(engine, "k")
    conninfo = sa.make_url(empty_pg_url).set(drivername="postgresql")
    with psycopg.connect(conninfo.render_as_string(hide_password=False), autocommit=True) as conn:
        conn.execute(convert)
        conn.execute(
            "CREATE TABLE outbox_messages_2026_11_25 PARTITION OF outbox_messages"
            " FOR VALUES FROM ('2026-11-25') TO ('2026-11-26')"
        )
        conn.execute("LISTEN saga_engine_outbox")
        write_message(engine, "k")
        assert [n.channel for n in conn.notifies(timeout=5, stop_after=1)] == ["saga_engine_outbox"]
        conn.execute("UPDATE outbox_messages SET created_at = '2026-11-25 12:00'")

        with pytest.raises(psycopg.errors.RaiseException, match="still holds unsent"):
            conn.execute(drop_day)
        relay = Relay(engine, SqlTransport(engine), RelayConfig(claim="skip_locked"))
        assert relay.run_once().published == 2
        conn.execute(drop_day)

        assert conn.execute("SELECT count(*) FROM outbox_messages").fetchone() == (0,)
