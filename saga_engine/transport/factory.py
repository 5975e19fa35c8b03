"""Builds a transport from a broker URL.

``sql://`` (the default) carries messages through a table of the engine's own database;
``kafka://host:port[,host:port...][?partitions=N]`` uses Kafka through kafka-python;
``memory://`` is the in-process double for unit tests.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from sqlalchemy import Engine

from saga_engine import errors
from saga_engine.transport.base import Transport

SCHEMES = ("sql", "kafka", "memory")


def from_url(url: str | None, *, engine: Engine | None = None) -> Transport:
    """The transport for ``url``; ``engine`` is the database the ``sql://`` transport uses."""
    parts = urlsplit(url or "sql://")
    if parts.scheme == "sql":
        if engine is None:
            raise errors.ConfigurationError("the sql:// transport needs a database (--db)")
        from saga_engine.transport.sql import SqlTransport

        return SqlTransport(engine)
    if parts.scheme == "kafka":
        from saga_engine.transport.kafka import KafkaTransport

        return KafkaTransport.from_url(parts)
    if parts.scheme == "memory":
        from saga_engine.transport.memory import MemoryTransport

        return MemoryTransport()
    raise errors.ConfigurationError(
        f"unknown broker URL {url!r}: expected one of {', '.join(s + '://' for s in SCHEMES)}"
    )
