"""Fixtures of the unit tests: no services."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from saga_engine import db, schema


@pytest.fixture
def memory_db() -> Iterator[sa.Engine]:
    """The engine's tables in an in-memory SQLite database (one connection per thread)."""
    engine = db.create_engine("sqlite://")
    schema.metadata.create_all(engine)
    yield engine
    engine.dispose()
