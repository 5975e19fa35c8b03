"""Fresh, empty databases for tests: one per test, dropped afterwards (no shared state).

The servers' addresses come from the environment (``SAGA_TEST_POSTGRES_URL``,
``SAGA_TEST_MARIADB_URL``, ``SAGA_TEST_REDIS_URL``) with the development machine's as defaults.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

from saga_engine import db, schema

POSTGRES_URL = os.environ.get(
    "SAGA_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
MARIADB_URL = os.environ.get("SAGA_TEST_MARIADB_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
REDIS_URL = os.environ.get("SAGA_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")

KINDS = ("sqlite", "postgres", "mariadb")


def server_error(kind: str) -> str | None:
    """None if the server of ``kind`` answers, else a one-line reason."""
    url = {"postgres": POSTGRES_URL, "mariadb": MARIADB_URL}.get(kind)
    if url is None:
        return None
    engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        return None
    except Exception as error:
        return f"{kind} not reachable at {db.redact(url)}: {str(error).strip().splitlines()[0]}"
    finally:
        engine.dispose()


@contextlib.contextmanager
def fresh_database(kind: str, tmp_path: Path, *, create_schema: bool = True) -> Iterator[str]:
    """A new empty database of ``kind``; yields its URL and drops it afterwards."""
    name = f"se_{uuid.uuid4().hex[:12]}"
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / (name + '.sqlite3')}"
        _create_schema(url, create_schema)
        yield url
        return
    admin_url = POSTGRES_URL if kind == "postgres" else MARIADB_URL
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    url = sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    try:
        _create_schema(url, create_schema)
        yield url
    finally:
        force = " WITH (FORCE)" if kind == "postgres" else ""  # ends leftover connections
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE {name}{force}"))
        admin.dispose()


def _create_schema(url: str, create: bool) -> None:
    if create:
        engine = db.create_engine(url)
        schema.metadata.create_all(engine)
        engine.dispose()
