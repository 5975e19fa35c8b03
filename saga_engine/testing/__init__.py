"""Test your sagas with the real engine: fault schedules for property tests (Hypothesis), and the
deterministic runtime and clock they run on. See docs/testing.md."""

from __future__ import annotations

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
