"""The transactional outbox: the writer (joins the caller's transaction), the relay, cleanup."""

from __future__ import annotations

from saga_engine.outbox.writer import DEFAULT_MAX_PAYLOAD_BYTES, OutboxWriter

__all__ = ["DEFAULT_MAX_PAYLOAD_BYTES", "OutboxWriter"]
