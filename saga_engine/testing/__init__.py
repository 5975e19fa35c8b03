"""Test your sagas with the real engine: a deterministic runtime and clock (and, in
``saga_engine.testing.faults``, fault schedules for property tests)."""

from __future__ import annotations

from saga_engine.testing.runtime import ManualClock, Runtime

__all__ = ["ManualClock", "Runtime"]
