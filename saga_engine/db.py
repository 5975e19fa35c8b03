"""Database adapter edge: engines from URLs, dialect differences, driver errors translated.

Everything dialect-specific that is not a claim strategy lives here, so the rest of the engine
speaks SQLAlchemy Core only.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import sqlite3
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy import event, exc
from sqlalchemy.engine import Connection, CursorResult, Dialect, Engine, make_url

from saga_engine import errors

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

SQLITE_BUSY_TIMEOUT_MS = 30_000
#: A pooled connection that sat unused for longer than this is pinged before it is handed out.
PING_AFTER_IDLE_S = 1.0
_CHECKED_IN_AT = "saga_engine.checked_in_at"


def redact(url: str | sa.URL) -> str:
    """The URL with its password hidden: safe for logs, status output and error messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (exc.ArgumentError, ValueError):
        return "<invalid database URL>"


def create_engine(url: str, *, pool_size: int = 5, **kwargs: Any) -> Engine:
    """An engine for ``url`` with settings every saga-engine process wants: pooled connections
    pinged only after an idle second (:func:`ping_after_idle`), savepoints sent as plain driver SQL
    (:func:`fast_savepoints`; ``app.start`` runs a saga's leading local steps in one), and on
    SQLite write transactions that begin with ``BEGIN IMMEDIATE``.

    Raises :class:`errors.ConfigurationError` for a URL that cannot be parsed or whose driver is
    not installed; reachability is checked by :func:`check_connection`.
    """
    try:
        parsed = make_url(url)
    except (exc.ArgumentError, ValueError) as error:
        raise errors.ConfigurationError(f"bad database URL {redact(url)!r}: {error}") from None
    try:
        if parsed.get_backend_name() == "sqlite":
            return fast_savepoints(_sqlite_engine(parsed, **kwargs))
        if parsed.get_backend_name() == "postgresql":
            # Before the engine exists: its dialect copies psycopg's adapters when it is made.
            _register_binary_lists()
        engine = sa.create_engine(
            parsed, pool_size=pool_size, max_overflow=pool_size, pool_recycle=1800, **kwargs
        )
    except (exc.NoSuchModuleError, ModuleNotFoundError) as error:
        raise errors.ConfigurationError(
            f"no driver for {redact(parsed)!r}: {error}; install saga-engine[postgres] or [mysql]"
        ) from None
    ping_after_idle(engine)
    return fast_savepoints(engine)


def ping_after_idle(engine: Engine, idle_seconds: float = PING_AFTER_IDLE_S) -> Engine:
    """Ping a pooled connection on checkout only if it sat idle for over ``idle_seconds``.

    Connections killed by the server (a restart, an idle timeout, a proxy) are then replaced, not
    reused, as with ``pool_pre_ping``, which pings on every checkout: a round trip that was three
    of a saga's 53 statements. A connection checked in a moment ago was alive a moment ago; if the
    server dropped it since, its first statement fails, SQLAlchemy discards every pooled
    connection older than that failure, and the caller's transaction is retried as after any
    lost connection (every consumer and relay pass is). Returns ``engine``.
    """

    def checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info[_CHECKED_IN_AT] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        checked_in_at = record.info.get(_CHECKED_IN_AT)
        if checked_in_at is None or time.monotonic() - checked_in_at <= idle_seconds:
            return  # new, or used a moment ago
        dialect = engine.dialect
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as error:
            if not dialect.is_disconnect(error, dbapi_connection, None):
                raise
            # The pool replaces this connection, and the others of its age, and checks out anew.
            raise exc.InvalidatePoolError(str(error)) from error

    event.listen(engine, "checkin", checkin)
    event.listen(engine, "checkout", checkout)
    return engine


def _sqlite_engine(url: sa.URL, **kwargs: Any) -> Engine:
    engine = sa.create_engine(url, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy, not pysqlite, emit BEGIN; WAL lets readers run beside the single writer.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        # busy_timeout first: switching a new file to WAL needs a moment of exclusive access, and
        # without the timeout a connection opened during another's write fails at once.
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        _switch_to_wal(cursor)
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # IMMEDIATE takes the write lock up front, so two writers queue on busy_timeout instead of
        # failing later with "database is locked" when a read transaction tries to upgrade.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _switch_to_wal(cursor: Any) -> None:
    """``PRAGMA journal_mode=WAL``, retried while SQLite answers "database is locked".

    While another connection switches the same new file, SQLite may refuse the change at once,
    without waiting on busy_timeout (seen with several workers opening a fresh database together).
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


def check_connection(engine: Engine) -> None:
    """Raise :class:`errors.DatabaseUnavailable` (password hidden) when the database is unreachable."""
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except exc.DBAPIError as error:
        reason = str(error.orig).strip().splitlines()[0] if error.orig else type(error).__name__
        raise errors.DatabaseUnavailable(
            f"cannot reach database {redact(engine.url)}: {reason}"
        ) from None


def server_version(engine: Engine) -> tuple[int, ...]:
    """The server's version, as SQLAlchemy's dialect parsed it (its leading numbers); (0,) when
    it could not."""
    with engine.connect() as conn:  # server_version_info is known only after a first connect
        conn.execute(sa.text("SELECT 1"))
    info = engine.dialect.server_version_info or ()
    leading = itertools.takewhile(lambda part: isinstance(part, int), info)
    return tuple(int(part) for part in leading) or (0,)


def dialect_name(bind: Connection | Engine) -> str:
    name = bind.dialect.name
    return "mysql" if name == "mariadb" else name


def delete_in_batches(
    engine: Engine,
    batch: Callable[[Connection], Mapping[str, int]],
    max_batches: int | None = None,
) -> tuple[collections.Counter[str], int]:
    """Run ``batch`` in a transaction of its own until one deletes nothing, or ``max_batches``.

    ``batch`` deletes a bounded number of rows and says how many, by name (a table, or what
    became of them); back come the sums and the number of batches that deleted any. Each batch
    commits on its own, so pruning a large table never holds a long lock or builds one huge undo
    log, and a pruner stopped half-way has kept what it did.
    """
    totals: collections.Counter[str] = collections.Counter()
    batches = 0
    while max_batches is None or batches < max_batches:
        with engine.begin() as conn:
            counts = batch(conn)
        if not any(counts.values()):
            break
        totals.update(counts)
        batches += 1
    return totals, batches


def check_pruning(batch_size: int, retention: timedelta) -> None:
    """Refuse a pruner's settings that would loop forever or delete everything at once."""
    if batch_size < 1:
        raise ValueError("batch_size must be positive")
    if retention <= timedelta(0):
        raise ValueError("retention must be positive")


def delete_older_than(
    engine: Engine,
    column: sa.Column[Any],
    retention: timedelta,
    *,
    now: datetime,
    batch_size: int = 1000,
    max_batches: int | None = None,
) -> int:
    """Delete the rows of ``column``'s table whose ``column`` is more than ``retention`` before
    ``now``, oldest first, ``batch_size`` at a time (see :func:`delete_in_batches`); returns how
    many. Rows whose ``column`` is NULL are never deleted.

    ``column`` should lead an index, or every batch reads the whole table. The table's key is
    selected first and deleted by value: DELETE ... LIMIT is MySQL-only.
    """
    check_pruning(batch_size, retention)
    table = column.table
    (key,) = table.primary_key.columns
    oldest = sa.select(key).where(column < now - retention).order_by(column).limit(batch_size)

    def batch(conn: Connection) -> dict[str, int]:
        keys = conn.scalars(oldest).all()
        return {
            "deleted": conn.execute(sa.delete(table).where(key.in_(keys))).rowcount if keys else 0
        }

    totals, _ = delete_in_batches(engine, batch, max_batches)
    return totals["deleted"]


def insert_ignoring_duplicates(
    bind: Connection, table: sa.Table, rows: list[dict[str, Any]]
) -> int:
    """Insert ``rows``, silently skipping those whose key exists; returns how many were new.

    A plain INSERT that hits the unique key would abort the whole transaction on PostgreSQL, so the
    caller's business change would be lost with it; the dialects' own "ignore" forms avoid that.
    """
    if not rows:
        return 0
    key = next(iter(table.primary_key.columns))
    return len(insert_new(bind, table, rows, key))


def insert_new(
    bind: Connection, table: sa.Table, rows: list[dict[str, Any]], key: sa.Column[Any]
) -> list[Any]:
    """Insert ``rows``, skipping those whose unique key exists; returns ``key`` of each new row.

    PostgreSQL and SQLite: one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` for all the rows (an
    executemany that SQLAlchemy sends as multi-row VALUES). MySQL/MariaDB: one ``INSERT IGNORE``
    per row, as their drivers report neither RETURNING for many rows nor a per-row count.
    """
    if not rows:
        return []
    name = dialect_name(bind)
    stmt = _ignoring_insert(name, table, key)
    if name in ("postgresql", "sqlite"):
        # rowcount of ON CONFLICT DO NOTHING is not reported by every driver (psycopg 3 gives -1),
        # so ask the database which rows it inserted.
        if len(rows) == 1:
            return list(bind.execute(stmt, rows[0]).scalars())
        return list(bind.execute(stmt, rows).scalars())
    return [row[key.key] for row in rows if bind.execute(stmt, row).rowcount]


class _BinaryList(list):  # type: ignore[type-arg]
    """A list psycopg sends in its binary array format (see :class:`Array`)."""


class Array(sa.TypeDecorator[list[Any]]):
    """A PostgreSQL array parameter that psycopg sends in binary form.

    psycopg's default, text form writes an array element by element in Python: binding the 500
    ids of a relay's batch cost 0.67-0.79 ms of client CPU, 0.32-0.36 ms in binary (500 keys:
    0.78-0.82 against 0.38-0.45), and a relay pass binds three such lists. For items psycopg takes
    as they are (ids, names): the elements go without SQLAlchemy's per-item processing.

    SQLAlchemy's psycopg dialect copies psycopg's adapters when it is made, so
    :func:`create_engine` registers the binary form before it makes an engine, and a process on
    SQLite or MySQL never imports psycopg for it. (In a process that made no engine that way,
    these lists keep the text form: slower, with the same result.)

    Only parameters of this type change form: a plain list a user binds elsewhere keeps the text
    form, whose untyped literal PostgreSQL fits to any column (a binary ``text[]`` would not
    compare with a ``uuid`` column, say). The statement casts the parameter to the array type, so
    the element type psycopg picks (``smallint[]`` for small ids) does not matter.
    """

    impl = sa.types.NullType
    cache_ok = True

    def __init__(self, item_type: Any) -> None:
        super().__init__()
        self.item_type = item_type

    def load_dialect_impl(self, dialect: sa.Dialect) -> Any:
        from sqlalchemy.dialects import postgresql

        return dialect.type_descriptor(postgresql.ARRAY(self.item_type))

    def bind_processor(self, dialect: sa.Dialect) -> Any:
        # In place of ARRAY's own, which copies the list into a plain one.
        return _binary_list


def _binary_list(value: Any) -> Any:
    return None if value is None else _BinaryList(value)


@functools.cache
def _register_binary_lists() -> None:
    try:
        import psycopg
        from psycopg.types.array import ListBinaryDumper
    except ImportError:  # no PostgreSQL driver installed: nothing binds these
        return
    psycopg.adapters.register_dumper(_BinaryList, ListBinaryDumper)


class DriverStatement:
    """A statement built once and sent as the driver's own SQL text where it can be.

    Executing a compiled statement costs client CPU on every call (cache lookup, parameter
    processing, result setup) even when the statement is built once: about a third of a one-row
    insert's. Where no parameter converts its value on the way in (PostgreSQL and MySQL for the
    engine's tables) and the parameters keep their names, the rows go to the driver as they are,
    with the text SQLAlchemy itself would send. Elsewhere (SQLite turns datetimes into text, a
    ``schema_translate_map`` renames tables) the compiled statement runs as usual.

    ``keys`` are the parameters every call passes: the columns an insert or an update sets, and
    the update's own bound names. Every call must pass exactly those.

    ``arrays``, on PostgreSQL, sends several rows as one statement (see :class:`ArrayRows`)
    instead of an executemany.
    """

    def __init__(
        self,
        statement: sa.Insert | sa.Update,
        keys: Sequence[str],
        *,
        arrays: ArrayRows | None = None,
    ) -> None:
        self.statement = statement
        self.keys = tuple(keys)
        self.arrays = arrays
        #: Per dialect: the text of one row (None: run the compiled statement) and the text of
        #: several (None: an executemany of the first).
        self._texts: weakref.WeakKeyDictionary[Dialect, tuple[str | None, str | None]] = (
            weakref.WeakKeyDictionary()
        )

    def execute(
        self, conn: Connection, params: dict[str, Any] | Sequence[dict[str, Any]]
    ) -> CursorResult[Any]:
        """Execute with one row of parameters, or with several (executemany, or one statement of
        arrays; a list of one row goes as that row, which costs the driver less)."""
        if not isinstance(params, dict) and len(params) == 1:
            params = params[0]
        one, many = self._text(conn.dialect)
        if one is None or conn.get_execution_options().get("schema_translate_map"):
            return conn.execute(self.statement, params)
        if many is not None and not isinstance(params, dict):
            assert self.arrays is not None  # only an ArrayRows gives a text of several rows
            return conn.exec_driver_sql(many, self.arrays.params(params))
        return conn.exec_driver_sql(one, params)

    def _text(self, dialect: Dialect) -> tuple[str | None, str | None]:
        try:
            return self._texts[dialect]
        except KeyError:
            one = self._compile(dialect)
            arrays = self.arrays if one is not None and uses_arrays(dialect) else None
            texts = self._texts[dialect] = (one, arrays.text(dialect) if arrays else None)
            return texts

    def _compile(self, dialect: Dialect) -> str | None:
        if dialect.paramstyle not in ("pyformat", "named"):  # rows are dicts: named parameters
            return None
        compiled = self.statement.compile(dialect=dialect, column_keys=list(self.keys))
        binds = getattr(compiled, "binds", {})
        if set(binds) != set(self.keys):
            return None  # parameters renamed, or some not given by the rows
        for bind in binds.values():
            if bind.type.dialect_impl(dialect).bind_processor(dialect) is not None:
                return None
        return str(compiled.string)


def uses_arrays(dialect: Dialect) -> bool:
    """Whether lists are bound as arrays (PostgreSQL) rather than as expanded ``IN`` lists, and
    several rows sent as one statement of arrays (:class:`ArrayRows`)."""
    return dialect.name == "postgresql"


def in_list(column: sa.ColumnElement[Any], name: str, *, array: bool) -> sa.ColumnElement[bool]:
    """``column IN (:name)`` for a list bound at execution.

    With ``array`` (PostgreSQL) the list is one array parameter (:class:`Array`, sent in
    binary), ``column = ANY(:name)``: the SQL text never changes, where an expanded ``IN`` renders
    and binds one parameter per element on every call (12.8 ms of client CPU for the order guard
    of a 500-row batch, against 2.0 ms).
    Elsewhere it is an expanding ``IN``, rendered per call but compiled once.
    """
    if array:
        return column == sa.any_(sa.bindparam(name, type_=Array(column.type)))
    return column.in_(sa.bindparam(name, expanding=True))


class ArrayRows:
    """Several rows of an insert or update as one statement on PostgreSQL: each parameter's
    values go as one binary array, and ``unnest`` makes rows of them again on the server.

    An executemany sends every row through psycopg's per-row path (parameters dumped and checked,
    one Bind and Execute each), and the server starts the statement once per row. Measured with
    the outbox's rows (one transaction of n rows each, alternated): at 100 rows 38 -> 29 us of
    client CPU and 22 -> 11 us of server CPU per row; at 20 rows 47-53 -> 43 and 29-33 -> 21; at
    5 rows the same client CPU and 52-56 against 55-60 us of server CPU. The text is the same for
    any number of rows, so the server parses and plans it once per session.

    Arrays are typed by the columns' base types (``text``, not ``varchar(64)``): an explicit cast
    to ``varchar(64)`` would cut a longer value short, where assigning ``text`` to the column
    refuses it, as an executemany's row would be refused.
    """

    def __init__(self, text: Callable[[Dialect], str], keys: Sequence[str]) -> None:
        #: The statement's text for a PostgreSQL dialect (``DriverStatement`` keeps it).
        self.text = text
        self.keys = tuple(keys)

    @classmethod
    def insert(cls, table: sa.Table, keys: Sequence[str]) -> ArrayRows:
        """``INSERT INTO table (keys) SELECT keys FROM unnest(...) ORDER BY`` their order: rows
        take the table's ids in the order they were given, as an executemany's do."""

        def text(dialect: Dialect) -> str:
            columns = ", ".join(_quoted(dialect, key) for key in keys)
            rows = _unnest(dialect, table, {key: key for key in keys}, ordinality=True)
            return (
                f"INSERT INTO {dialect.identifier_preparer.format_table(table)} ({columns}) "
                f"SELECT {columns} FROM {rows} ORDER BY u.saga_engine_row"
            )

        return cls(text, keys)

    @classmethod
    def update(cls, table: sa.Table, keys: Sequence[str], where: Mapping[str, str]) -> ArrayRows:
        """``UPDATE table SET key = u.key ... FROM unnest(...) AS u WHERE`` each column of
        ``where`` equals its parameter (``{"id": "b_id"}``). The row count is the rows updated,
        as an executemany's is; each row of the table must match at most one of the rows given."""
        columns = [key for key in keys if key not in where.values()]
        params = {**{c: c for c in columns}, **{param: column for column, param in where.items()}}

        def text(dialect: Dialect) -> str:
            name = dialect.identifier_preparer.format_table(table)
            sets = ", ".join(f"{_quoted(dialect, c)} = u.{_quoted(dialect, c)}" for c in columns)
            matches = " AND ".join(
                f"{name}.{_quoted(dialect, column)} = u.{_quoted(dialect, param)}"
                for column, param in where.items()
            )
            rows = _unnest(dialect, table, params, ordinality=False)
            return f"UPDATE {name} SET {sets} FROM {rows} WHERE {matches}"

        return cls(text, keys)

    def params(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """One array per parameter, the rows' values in their order."""
        return {key: _BinaryList([row[key] for row in rows]) for key in self.keys}


def _quoted(dialect: Dialect, name: str) -> str:
    return str(dialect.identifier_preparer.quote(name))


def _unnest(
    dialect: Dialect, table: sa.Table, params: Mapping[str, str], *, ordinality: bool
) -> str:
    """``unnest(%(p)s::type[], ...) AS u(p, ...)`` for parameters ``p`` of ``table``'s columns
    (``params``: parameter -> column)."""
    arrays = ", ".join(
        f"%({param})s::{_array_item(dialect, table.c[column].type)}[]"
        for param, column in params.items()
    )
    names = [_quoted(dialect, param) for param in params]
    if ordinality:
        return f"unnest({arrays}) WITH ORDINALITY AS u({', '.join(names)}, saga_engine_row)"
    return f"unnest({arrays}) AS u({', '.join(names)})"


def _array_item(dialect: Dialect, type_: sa.types.TypeEngine[Any]) -> str:
    if isinstance(type_, sa.String):  # Text too: no length, see ArrayRows
        return "text"
    return str(type_.compile(dialect=dialect))


def insert_new_keys(
    bind: Connection,
    table: sa.Table,
    key: sa.Column[Any],
    keys: list[Any],
    constants: dict[str, Any],
) -> list[Any]:
    """Insert one row per value of ``keys``, each with ``constants`` in its other columns; skip
    the values that exist. Returns the values inserted, as :func:`insert_new` does.

    On PostgreSQL the keys go as one array, ``INSERT ... SELECT ... FROM unnest(:keys)``: the SQL
    text is the same for any number of keys, where a multi-row ``VALUES`` renders a parameter per
    column and row, and the driver parses a new text on every call (for the inbox, 7 % of a saga
    worker's GIL time). Rows are inserted in the order of ``keys``. Elsewhere: :func:`insert_new`.
    """
    if not keys:
        return []
    if dialect_name(bind) != "postgresql":
        rows = [{**constants, key.key: value} for value in keys]
        return insert_new(bind, table, rows, key)
    stmt = _array_insert(table, key, tuple(sorted(constants)))
    return list(bind.execute(stmt, {**constants, "keys": keys}).scalars())


_ARRAY_INSERTS: dict[tuple[str, str, tuple[str, ...]], Any] = {}


def _array_insert(table: sa.Table, key: sa.Column[Any], constants: tuple[str, ...]) -> Any:
    """``INSERT INTO table (constants..., key) SELECT :constants..., k FROM unnest(:keys) AS k
    ON CONFLICT DO NOTHING RETURNING key``, built once per table, key and set of constants."""
    cache_key = (table.fullname, key.key, constants)
    stmt = _ARRAY_INSERTS.get(cache_key)
    if stmt is None:
        from sqlalchemy.dialects import postgresql

        keys = (
            sa.func.unnest(sa.bindparam("keys", type_=Array(key.type)))
            .table_valued("k")
            .render_derived(name="keys")
        )
        values = [sa.bindparam(name, type_=table.c[name].type) for name in constants]
        rows = sa.select(*values, keys.c.k)
        stmt = (
            postgresql.insert(table)
            .from_select([*constants, key.key], rows)
            .on_conflict_do_nothing()
            .returning(key)
        )
        _ARRAY_INSERTS[cache_key] = stmt
    return stmt


#: Statements built once per dialect, table and key: building one anew costs as much client CPU
#: as executing it.
_IGNORING_INSERTS: dict[tuple[str, str, str], Any] = {}


def _ignoring_insert(name: str, table: sa.Table, key: sa.Column[Any]) -> Any:
    cache_key = (name, table.fullname, key.key)
    stmt = _IGNORING_INSERTS.get(cache_key)
    if stmt is None:
        if name in ("postgresql", "sqlite"):
            stmt = _upsert_insert(name)(table).on_conflict_do_nothing().returning(key)
        else:
            stmt = table.insert().prefix_with("IGNORE")
        _IGNORING_INSERTS[cache_key] = stmt
    return stmt


def _upsert_insert(name: str) -> Any:
    if name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    return sqlite_insert


def fast_savepoints(engine: Engine) -> Engine:
    """Make ``engine`` send SAVEPOINT, RELEASE and ROLLBACK TO as plain driver SQL; returns it.

    SQLAlchemy compiles its savepoint clauses anew for every savepoint (they are not cacheable),
    which doubles the client CPU of a savepoint; the text it sends is the same. Every command
    handler and local step runs in a savepoint, so that is two statements per message. Dialects
    that emit savepoints their own way are left alone. Idempotent.

    On PostgreSQL through psycopg a release is also deferred (see ``_DeferredRelease``): it goes
    out with the next SAVEPOINT, in the same round trip, or not at all when the transaction's
    COMMIT releases it. A batch of handlers then costs one round trip per savepoint, not two.
    """
    dialect = engine.dialect
    if getattr(dialect, "_saga_engine_fast_savepoints", False):
        return engine
    default = sa.engine.default.DefaultDialect
    cls = type(dialect)
    if any(
        getattr(cls, name) is not getattr(default, name)
        for name in ("do_savepoint", "do_release_savepoint", "do_rollback_to_savepoint")
    ):
        return engine
    quote = dialect.identifier_preparer.quote
    deferred = (
        _DeferredRelease() if (dialect.name, dialect.driver) == ("postgresql", "psycopg") else None
    )

    def do_savepoint(connection: Connection, name: str) -> None:
        sql = f"SAVEPOINT {quote(name)}"
        pending = deferred.take(connection) if deferred else None
        if pending is not None:
            sql = f"RELEASE SAVEPOINT {quote(pending)}; {sql}"
        connection.exec_driver_sql(sql)

    def do_release_savepoint(connection: Connection, name: str) -> None:
        if deferred is None:
            connection.exec_driver_sql(f"RELEASE SAVEPOINT {quote(name)}")
        else:
            deferred.put(connection, name)

    def do_rollback_to_savepoint(connection: Connection, name: str) -> None:
        if deferred is not None:
            deferred.take(connection)  # a released savepoint inside ``name``: rolled back with it
        connection.exec_driver_sql(f"ROLLBACK TO SAVEPOINT {quote(name)}")

    if deferred is not None:  # the transaction's end ends the savepoint: nothing to send later
        event.listen(engine, "commit", deferred.forget)
        event.listen(engine, "rollback", deferred.forget)
    # Instance attributes shadow the class's methods for this engine's dialect only.
    dialect.do_savepoint = do_savepoint  # type: ignore[method-assign]
    dialect.do_release_savepoint = do_release_savepoint  # type: ignore[method-assign]
    dialect.do_rollback_to_savepoint = do_rollback_to_savepoint  # type: ignore[method-assign]
    dialect._saga_engine_fast_savepoints = True  # type: ignore[attr-defined]
    return engine


class _DeferredRelease:
    """The savepoint a connection released in SQLAlchemy's view but not yet on the server.

    Until it goes out, the server keeps that savepoint open, and what the transaction runs next
    runs inside it. Nothing can tell the difference, because of where the savepoint sits: every
    savepoint SQLAlchemy still holds open encloses it. So a ROLLBACK TO any of them undoes it too,
    a RELEASE of any of them releases it too (it is then the one left pending), a new savepoint
    must not nest in it (the RELEASE is sent first, in the same text), and COMMIT or ROLLBACK of
    the transaction ends it with everything else. An error inside it aborts it, which aborts the
    enclosing savepoint or transaction the caller rolls back anyway. The entry is tied to the
    transaction it was made in, so a later transaction on the same connection never sees it.
    """

    _KEY = "saga_engine.release_pending"

    def put(self, connection: Connection, name: str) -> None:
        connection.info[self._KEY] = (connection.get_transaction(), name)

    def forget(self, connection: Connection) -> None:
        # An invalidated connection (its server connection was lost) has no info to reach: asking
        # would raise in the middle of the rollback and hide the error that invalidated it. The
        # pool clears a record's info when it connects it again.
        if not connection.invalidated:
            connection.info.pop(self._KEY, None)

    def take(self, connection: Connection) -> str | None:
        entry = connection.info.pop(self._KEY, None)
        if entry is None:
            return None
        transaction, name = entry
        return name if transaction is connection.get_transaction() else None


@contextlib.contextmanager
def session_in_savepoint(conn: Connection) -> Iterator[Session]:
    """A ``Session`` on ``conn`` whose work is one savepoint of ``conn``'s transaction.

    The savepoint is released when the block ends and rolled back when it raises; the exception
    goes on. It is taken when the Session first needs the database (a query, a flush, its
    ``connection()``), so a handler or local step that never touches it costs no savepoint at all:
    it has written nothing that a rejection would have to undo. The savepoint is taken on the
    Connection and the Session only joins it (``rollback_only``): a ``session.rollback()`` rolls
    back the savepoint, never the caller's transaction, and work after it goes into a new one; a
    ``session.commit()`` flushes without releasing it. That is what a handler saw when the Session
    made the savepoint itself, for a fraction of the client CPU.
    """
    session = _savepoint_session()(bind=conn, join_transaction_mode="rollback_only")
    try:
        yield session
        # Pending ORM changes go into the savepoint. A commit() would do the same (the Session
        # never commits a transaction it joined) and then end its own bookkeeping, which close()
        # ends anyway: 15 us more per handler for nothing.
        session.flush()
    except BaseException:
        session.close()
        session.end_savepoint(release=False)
        raise
    session.close()
    session.end_savepoint(release=True)


@functools.cache
def _savepoint_session() -> type[Any]:
    """The Session class of :func:`session_in_savepoint` (made on first use: importing the ORM
    costs every command that never needs it)."""
    from sqlalchemy.orm import Session

    class SavepointSession(Session):
        """A Session bound to a Connection that takes a savepoint of it before its first use."""

        saga_engine_savepoint: sa.NestedTransaction | None = None

        def get_bind(self, *args: Any, **kwargs: Any) -> Any:
            # Every way the Session reaches the database asks for its bind first: a flush, an
            # execute, connection(). A savepoint rolled back (by the handler's own rollback())
            # is replaced, so what the handler does next is undone alone if it raises.
            savepoint = self.saga_engine_savepoint
            if savepoint is None or not savepoint.is_active:
                assert isinstance(self.bind, Connection)
                self.saga_engine_savepoint = self.bind.begin_nested()
            return super().get_bind(*args, **kwargs)

        def end_savepoint(self, *, release: bool) -> None:
            """Release the savepoint, or roll it back; nothing if none was taken, or if a failed
            flush or the block's own rollback() already rolled it back."""
            savepoint = self.saga_engine_savepoint
            if savepoint is None or not savepoint.is_active:
                return
            if release:
                savepoint.commit()
            else:
                savepoint.rollback()

    return SavepointSession


def connection_of(tx: Any) -> Connection:
    """The Connection behind a SQLAlchemy ``Session`` or ``Connection`` (the caller's transaction)."""
    if isinstance(tx, Connection):
        return tx
    from sqlalchemy.orm import Session

    if isinstance(tx, Session):
        return tx.connection()
    raise TypeError(f"expected a SQLAlchemy Session or Connection, got {type(tx).__name__}")
