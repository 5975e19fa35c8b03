"""Schema creation and upgrades: the Alembic migrations packaged in ``saga_engine/migrations``.

Users never need an ``alembic.ini``: :func:`upgrade` configures Alembic in code, with the script
directory inside the installed package and a version table of its own,
``saga_engine_alembic_version``, so the engine's history never collides with the application's
Alembic history in the same database. ``saga-engine db upgrade --db URL`` calls :func:`upgrade`.

- Upgrading takes a lock first (``pg_advisory_xact_lock`` on PostgreSQL, ``GET_LOCK`` on
  MySQL/MariaDB; SQLite's write lock), so workers that all upgrade at start-up do it one at a time;
  the later ones find the database at head and do nothing. Running it twice is a no-op.
- On PostgreSQL the whole upgrade is one transaction. MySQL and MariaDB commit each DDL statement
  on their own; a failed upgrade there can leave part of a revision behind.
- A database that already has the engine's tables but no version table (made with
  ``metadata.create_all``, as demos and tests do) is adopted, that is stamped at head, when its
  tables equal this version's schema exactly, and refused with a clear error otherwise; once you
  know which revision it matches, record it with ``python -m saga_engine.migrate stamp REV``.

Adding a revision (for maintainers of saga-engine)
---------------------------------------------------

Revisions are numbered ``0001``, ``0002``, ... and frozen: a revision never imports
:mod:`saga_engine.schema` (it keeps changing); it spells out its tables and types, as 0001 does.

1. Change :mod:`saga_engine.schema`, e.g. add a column to ``saga_instances``.
2. From a checkout with the editable install, generate the next revision::

       .venv/bin/python -m saga_engine.migrate revision -m "saga instance owner"

   This upgrades a scratch SQLite database to the current head, compares it with
   ``schema.metadata`` (Alembic autogenerate, with this module's :func:`context_options`:
   batch mode for SQLite, types and server defaults compared, only the engine's tables) and writes
   ``saga_engine/migrations/versions/0003_saga_instance_owner.py``, formatted by ruff if it is
   installed. ``--db URL`` compares against a scratch PostgreSQL or MariaDB database instead
   (upgraded to head first); ``--empty`` writes a blank revision for hand-written DDL.
3. Review and tidy it. Autogenerate does not see the PostgreSQL triggers of
   ``schema.POSTGRES_TRIGGERS`` and takes a renamed column for a drop plus an add. Its long
   ``with_variant(...)`` chains read better as local copies of the type helpers (see 0001).
4. ``tests/integration/test_migrations.py`` checks on SQLite, PostgreSQL and MariaDB that
   upgrading an empty database produces exactly ``schema.metadata``; it fails until the revision
   is right.

Other helpers: ``python -m saga_engine.migrate current --db URL`` (the revision of a database),
``... sql --db URL`` (print the DDL for a DBA instead of running it), ``... upgrade``,
``... stamp REV``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import io
import logging
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, exc

from saga_engine import db, errors, schema

log = logging.getLogger(__name__)

SCRIPT_LOCATION = "saga_engine:migrations"
VERSION_TABLE = "saga_engine_alembic_version"
#: Key of the PostgreSQL advisory lock / name of the MySQL lock taken while upgrading.
LOCK_KEY = 0x5A6A_E461_0001
LOCK_NAME = "saga_engine_migrations"
LOCK_TIMEOUT_SECONDS = 300
#: MySQL and MariaDB refuse lock names longer than this.
MYSQL_LOCK_NAME_MAX = 64


def mysql_lock_name(database: str) -> str:
    """The MySQL lock of ``database``'s upgrades.

    ``GET_LOCK`` names are global to the server, unlike PostgreSQL's advisory locks (which belong
    to one database), so the name carries the database: upgrades of two databases on one server
    need not wait for each other. A name too long for the server is shortened to a digest.
    """
    name = f"{LOCK_NAME}.{database}"
    if len(name) <= MYSQL_LOCK_NAME_MAX:
        return name
    return f"{LOCK_NAME}.{hashlib.sha1(database.encode()).hexdigest()}"


def upgrade(
    url: str, revision: str = "head", *, script_location: str = SCRIPT_LOCATION
) -> str | None:
    """Bring the database at ``url`` to ``revision``; returns the revision it is at afterwards.

    Raises :class:`errors.ConfigurationError` for a bad URL, an unknown revision or an unversioned
    database whose engine tables differ from the schema, :class:`errors.DatabaseUnavailable` when
    the database cannot be reached.
    """
    with _connection(url) as conn, _migration_lock(conn):
        cfg = config(conn, script_location)
        _adopt_unversioned(conn, cfg, script_location)
        command.upgrade(cfg, revision)
        return _current(conn)


def downgrade(url: str, revision: str, *, script_location: str = SCRIPT_LOCATION) -> str | None:
    """Take the database at ``url`` back to ``revision`` (``"base"`` drops every engine table)."""
    with _connection(url) as conn, _migration_lock(conn):
        command.downgrade(config(conn, script_location), revision)
        return _current(conn)


def current(url: str) -> str | None:
    """The revision the database at ``url`` is at, or None if it was never migrated."""
    with _connection(url) as conn:
        return _current(conn)


def head(script_location: str = SCRIPT_LOCATION) -> str | None:
    """The newest revision shipped with this version of saga-engine."""
    return ScriptDirectory.from_config(config(None, script_location)).get_current_head()


def stamp(url: str, revision: str, *, script_location: str = SCRIPT_LOCATION) -> None:
    """Record ``revision`` as current without running anything (adopting an existing schema)."""
    with _connection(url) as conn, _migration_lock(conn):
        command.stamp(config(conn, script_location), revision)


def sql(url: str, revision: str = "head", *, script_location: str = SCRIPT_LOCATION) -> str:
    """The DDL that upgrading an empty database at ``url`` would run, without connecting."""
    cfg = config(None, script_location)
    cfg.attributes["url"] = _parse(url)
    cfg.output_buffer = io.StringIO()
    try:
        command.upgrade(cfg, revision, sql=True)
    except CommandError as error:
        raise errors.ConfigurationError(f"cannot migrate: {error}") from None
    return cfg.output_buffer.getvalue()


def revision(
    message: str,
    *,
    url: str | None = None,
    autogenerate: bool = True,
    script_location: str = SCRIPT_LOCATION,
) -> Path:
    """Write the next revision (``0002_...``) comparing ``schema.metadata`` with the migrations.

    Compares against a scratch SQLite database unless ``url`` names a scratch database. Run it
    from a checkout with the editable install: the file goes into the package's ``versions``.
    """
    with contextlib.ExitStack() as stack:
        if url is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            url = f"sqlite:///{scratch / 'revision.sqlite3'}"
        if autogenerate:
            upgrade(url, "head", script_location=script_location)
        conn = stack.enter_context(_connection(url))
        cfg = config(conn, script_location)
        _format_with_ruff(cfg)
        script = command.revision(
            cfg, message=message, autogenerate=autogenerate, rev_id=next_revision_id(cfg)
        )
    assert script is not None and not isinstance(script, list)
    return Path(script.path)


def _format_with_ruff(cfg: Config) -> None:
    """Format the new file as the rest of the code base, when ruff is installed."""
    if importlib.util.find_spec("ruff") is not None:
        cfg.set_section_option("post_write_hooks", "hooks", "ruff")
        cfg.set_section_option("post_write_hooks", "ruff.type", "module")
        cfg.set_section_option("post_write_hooks", "ruff.module", "ruff")
        cfg.set_section_option(
            "post_write_hooks", "ruff.options", "format REVISION_SCRIPT_FILENAME"
        )


def next_revision_id(cfg: Config) -> str:
    """Revisions are numbered 0001, 0002, ... so their order is visible in the file names."""
    numbers = [int(s.revision) for s in ScriptDirectory.from_config(cfg).walk_revisions()]
    return f"{max(numbers, default=0) + 1:04d}"


def config(conn: Connection | None, script_location: str = SCRIPT_LOCATION) -> Config:
    """The Alembic configuration, in code; ``env.py`` runs the migrations on ``conn``."""
    cfg = Config()
    cfg.set_main_option("script_location", script_location)
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("file_template", "%%(rev)s_%%(slug)s")
    cfg.attributes["connection"] = conn
    return cfg


def context_options(dialect_name: str) -> dict[str, Any]:
    """Options for ``context.configure`` and for comparing a database with ``schema.metadata``."""
    return {
        "target_metadata": schema.metadata,
        "version_table": VERSION_TABLE,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        "render_as_batch": dialect_name == "sqlite",
        "compare_type": True,
        "compare_server_default": _same_server_default,
        "include_name": _only_engine_tables,
    }


def _same_server_default(
    _context: Any,
    _inspected_column: Any,
    _metadata_column: Any,
    inspected_default: str | None,
    _metadata_default: Any,
    rendered_metadata_default: str | None,
) -> bool | None:
    """False when the defaults are equal; None lets Alembic's own comparison decide.

    Alembic's SQLite and MySQL comparers report ``''`` as differing from the reflected ``''``.
    """
    if inspected_default is None or rendered_metadata_default is None:
        return None
    return False if _unquoted(inspected_default) == _unquoted(rendered_metadata_default) else None


def _unquoted(default: str) -> str:
    default = default.strip()
    while default.startswith("(") and default.endswith(")"):
        default = default[1:-1].strip()
    if len(default) >= 2 and default[0] == default[-1] == "'":
        default = default[1:-1]
    return default


def _only_engine_tables(name: str | None, type_: str, _parents: Any) -> bool:
    # The engine shares the database with the application: never touch the application's tables.
    return type_ != "table" or name in schema.metadata.tables


def _parse(url: str) -> sa.URL:
    try:
        parsed = sa.make_url(url)
        parsed.get_dialect()
    except exc.NoSuchModuleError as error:
        raise errors.ConfigurationError(f"no driver for {db.redact(url)!r}: {error}") from None
    except (exc.ArgumentError, ValueError) as error:  # ValueError: e.g. a port that is no number
        raise errors.ConfigurationError(f"bad database URL: {error}") from None
    return parsed


@contextlib.contextmanager
def _connection(url: str) -> Iterator[Connection]:
    """A connection in a transaction (committed on success), with driver errors translated."""
    engine = db.create_engine(_parse(url).render_as_string(hide_password=False), pool_size=1)
    try:
        db.check_connection(engine)
        with engine.begin() as conn:
            yield conn
    except CommandError as error:  # an unknown or unreachable revision
        raise errors.ConfigurationError(f"cannot migrate: {error}") from None
    except exc.DBAPIError as error:
        if not error.connection_invalidated:
            raise  # a failing statement is a bug in a revision: let it show
        reason = _first_line(error.orig if error.orig is not None else error)
        raise errors.DatabaseUnavailable(
            f"database {db.redact(engine.url)} failed during migration: {reason}"
        ) from None
    finally:
        engine.dispose()


@contextlib.contextmanager
def _migration_lock(conn: Connection) -> Iterator[None]:
    """One upgrade at a time per database, so concurrent start-ups do not collide."""
    name = db.dialect_name(conn)
    if name == "postgresql":
        # Released when the transaction ends, i.e. after the upgrade committed.
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": LOCK_KEY})
        yield
    elif name == "mysql":
        lock = mysql_lock_name(conn.scalar(sa.text("SELECT DATABASE()")) or "")
        got = conn.scalar(
            sa.text("SELECT GET_LOCK(:name, :timeout)"),
            {"name": lock, "timeout": LOCK_TIMEOUT_SECONDS},
        )
        if got != 1:
            raise errors.DatabaseUnavailable(
                f"another saga-engine migration held {lock!r} for {LOCK_TIMEOUT_SECONDS} s"
            )
        try:
            yield
        finally:
            conn.scalar(sa.text("SELECT RELEASE_LOCK(:name)"), {"name": lock})
    else:
        yield  # SQLite: the transaction began with BEGIN IMMEDIATE, the database's write lock


def _adopt_unversioned(conn: Connection, cfg: Config, script_location: str) -> None:
    """Stamp a database made by ``metadata.create_all`` at head, or refuse a partial one.

    ``schema.metadata`` is exactly what this version's head creates (the migration tests prove it),
    so a database whose engine tables equal it is at head; anything else is not ours to guess.
    """
    inspector = sa.inspect(conn)
    if inspector.has_table(VERSION_TABLE):
        return
    existing = sorted(set(inspector.get_table_names()) & set(schema.metadata.tables))
    if not existing:
        return
    if script_location == SCRIPT_LOCATION and not differences(conn):
        log.info("adopting %s: its schema equals head", db.redact(conn.engine.url))
        command.stamp(cfg, "head")
        return
    raise errors.ConfigurationError(
        f"database {db.redact(conn.engine.url)} has saga-engine tables ({', '.join(existing)}) "
        f"but no {VERSION_TABLE} table, and they differ from this version's schema; once you "
        "know which revision they match, record it with "
        "'python -m saga_engine.migrate stamp REVISION --db URL'"
    )


def differences(conn: Connection) -> list[Any]:
    """What Alembic's autogenerate would change to turn the database into ``schema.metadata``."""
    context = MigrationContext.configure(conn, opts=context_options(conn.dialect.name))
    return list(compare_metadata(context, schema.metadata))


def _current(conn: Connection) -> str | None:
    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# -- python -m saga_engine.migrate ------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        print(_run(args))
    except errors.SagaEngineError as error:
        print(f"saga-engine: error: {error}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m saga_engine.migrate", description="saga-engine's own Alembic migrations"
    )
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    upgrade_ = sub.add_parser("upgrade", help="upgrade a database (as saga-engine db upgrade)")
    current_ = sub.add_parser("current", help="print the revision of a database")
    sql_ = sub.add_parser("sql", help="print the upgrade DDL instead of running it")
    stamp_ = sub.add_parser("stamp", help="record a revision as current without running it")
    for action in (upgrade_, current_, sql_, stamp_):
        action.add_argument("--db", metavar="URL", required=True, help="SQLAlchemy database URL")
    for action in (upgrade_, sql_):
        action.add_argument("revision", nargs="?", default="head")
    stamp_.add_argument("revision")
    revision_ = sub.add_parser("revision", help="write the next revision file (maintainers)")
    revision_.add_argument("-m", "--message", required=True)
    revision_.add_argument("--db", metavar="URL", help="a scratch database to compare against")
    revision_.add_argument(
        "--empty", action="store_true", help="an empty revision, no autogenerate"
    )
    return parser


def _run(args: argparse.Namespace) -> str:
    if args.action == "upgrade":
        return f"{db.redact(args.db)} is at {upgrade(args.db, args.revision)}"
    if args.action == "current":
        return str(current(args.db))
    if args.action == "sql":
        return sql(args.db, args.revision)
    if args.action == "stamp":
        stamp(args.db, args.revision)
        return f"{db.redact(args.db)} stamped {args.revision}"
    return str(revision(args.message, url=args.db, autogenerate=not args.empty))


if __name__ == "__main__":
    raise SystemExit(main())
