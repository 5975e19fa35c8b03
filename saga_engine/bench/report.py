"""Figures as a benchmark prints them: one aligned line each, then (``--json``) one JSON object.

Lines are printed as figures are measured, so a long run shows its progress; the JSON object on the
last line repeats every printed figure under its key, with the targets and whether each was met.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from typing import Any, TextIO

LABEL_WIDTH = 46


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by the nearest-rank method; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def shown(value: Any) -> str:
    """A figure as printed: thousands separated, floats to a precision that suits their size."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3g}"


def rounded(value: float, digits: int = 3) -> float:
    """``value`` with ``digits`` significant decimals kept readable in JSON."""
    if math.isnan(value) or math.isinf(value):
        return value
    return round(value, digits)


class Report:
    """Collects the figures of one benchmark run and prints them."""

    def __init__(self, bench: str, *, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.data: dict[str, Any] = {"bench": bench}
        self.targets: dict[str, dict[str, Any]] = {}
        self.data["targets"] = self.targets

    def section(self, title: str) -> None:
        print(f"\n== {title}", file=self.out, flush=True)

    def note(self, text: str) -> None:
        print(f"   {text}", file=self.out, flush=True)

    def figure(self, key: str, value: Any, label: str, unit: str = "") -> Any:
        """Record ``value`` under ``key`` and print it; returns the value."""
        if isinstance(value, float):
            value = rounded(value)
        self.data[key] = value
        line = f"   {label:<{LABEL_WIDTH}} {shown(value)} {unit}"
        print(line.rstrip(), file=self.out, flush=True)
        return value

    def rest(self, key: str, value: float, label: str, unit: str) -> float:
        """The machine's CPU left after the processes measured on their own, which the database
        (when it runs here) takes. Said to be unreliable when it comes out below zero."""
        self.figure(key, value, label, unit)
        if value < 0:
            # /proc/stat counts the machine in clock ticks; getrusage counts a process exactly.
            self.note(
                "(below zero: the machine's total, counted in clock ticks, fell short of the "
                "processes' exact CPU; this split is not reliable)"
            )
        return value

    def ratio(self, key: str, numerator: float, denominator: float, label: str) -> float:
        value = numerator / denominator if denominator else math.nan
        self.figure(key, value, label, "x")
        return value

    def target(self, key: str, met: bool, text: str) -> bool:
        """Record whether a target of the issue was met (never an assertion)."""
        self.targets[key] = {"met": bool(met), "target": text}
        print(f"   target {text:<{LABEL_WIDTH - 7}} {'MET' if met else 'MISSED'}", file=self.out)
        return met

    def json_line(self) -> None:
        print(json.dumps(self.data, sort_keys=True, default=str), file=self.out, flush=True)
