"""The engine's connection pool against servers that drop its connections.

A connection that sat idle in the pool is pinged before it is handed out, so one the server killed
meanwhile is replaced and the caller never sees it. A connection used a moment ago is handed out
without that round trip: if the server killed it in between, its first statement fails as a
disconnect and the pool's next connection is a new one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, exc

from saga_engine import db
from tests.conftest import database_url

SERVERS = {
    "postgres": ("SELECT pg_backend_pid()", "SELECT pg_terminate_backend({id})"),
    "mariadb": ("SELECT CONNECTION_ID()", "KILL {id}"),
}


@dataclasses.dataclass
class Pool:
    """An engine of one connection, and a way to have the server kill a connection."""

    engine: Engine
    kind: str
    killer: Engine

    def backend_id(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.scalar(sa.text(SERVERS[self.kind][0])))

    def kill(self, backend: int) -> None:
        with self.killer.connect() as conn:
            conn.execute(sa.text(SERVERS[self.kind][1].format(id=backend)))
        time.sleep(0.2)  # the server closes the socket after it answered


@pytest.fixture(
    params=[
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ]
)
def pool(request: pytest.FixtureRequest, tmp_path: Path, engines: list[object]) -> Iterator[Pool]:
    for url in database_url(request.param, tmp_path):
        pool = Pool(db.create_engine(url, pool_size=1), request.param, db.create_engine(url))
        engines += [pool.engine, pool.killer]
        yield pool


def test_an_idle_connection_the_server_killed_is_replaced_unseen(pool: Pool) -> None:
    first = pool.backend_id()
    pool.kill(first)
    time.sleep(db.PING_AFTER_IDLE_S + 0.1)

    second = pool.backend_id()  # raises if the dead connection were handed out

    assert second != first


def test_a_connection_used_a_moment_ago_is_handed_out_without_a_ping(pool: Pool) -> None:
    first = pool.backend_id()
    pool.kill(first)  # well within PING_AFTER_IDLE_S of the checkin

    with pytest.raises(exc.DBAPIError) as raised:
        pool.backend_id()
    assert raised.value.connection_invalidated  # seen as a disconnect: the pool is renewed
    assert pool.backend_id() != first
