"""Broker adapters. ``from_url`` picks one from a broker URL (``sql://``, ``kafka://host:port``)."""

from __future__ import annotations

from saga_engine.transport.base import (
    Consumer,
    Delivery,
    OutgoingMessage,
    PublishResult,
    Transport,
)
from saga_engine.transport.factory import from_url

__all__ = ["Consumer", "Delivery", "OutgoingMessage", "PublishResult", "Transport", "from_url"]
