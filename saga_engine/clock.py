"""Time, passed in rather than read from the wall, so tests and the simulator can control it.

Every timestamp the engine stores is naive UTC: MariaDB's DATETIME has no time zone, and one
convention for all three databases keeps comparisons in SQL portable.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time as naive UTC."""
        ...


class SystemClock:
    """The wall clock."""

    def now(self) -> datetime:
        return datetime.now(UTC).replace(tzinfo=None)


SYSTEM = SystemClock()
