"""Test your sagas with the real engine: fault schedules for property tests (Hypothesis), and the
deterministic runtime and clock they run on; and a real Kafka-protocol broker for integration tests
(``saga_engine.testing.tansu``). See docs/testing.md.

The names below are imported on first use, so that ``saga_engine.testing.tansu`` (which the
benchmarks use too) needs neither Hypothesis nor the engine's orchestration modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from saga_engine.testing.faults import (
        BrokerOutage,
        ConsumerCrash,
        Delay,
        Duplicate,
        FaultSchedule,
        Reject,
        RelayCrash,
        Simulation,
        Transient,
        fault_schedules,
        simulate,
    )
    from saga_engine.testing.runtime import ManualClock, Runtime

__all__ = [
    "BrokerOutage",
    "ConsumerCrash",
    "Delay",
    "Duplicate",
    "FaultSchedule",
    "ManualClock",
    "Reject",
    "RelayCrash",
    "Runtime",
    "Simulation",
    "Transient",
    "fault_schedules",
    "simulate",
]
_IN_RUNTIME = ("ManualClock", "Runtime")


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = "runtime" if name in _IN_RUNTIME else "faults"
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
