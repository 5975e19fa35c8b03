"""saga-engine: saga orchestration on the transactional outbox."""

from __future__ import annotations

__version__ = "0.1.0"
