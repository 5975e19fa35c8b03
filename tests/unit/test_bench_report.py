"""How the benchmarks print their figures."""

from __future__ import annotations

import io
import json

from saga_engine.bench.report import Report


def test_a_rest_below_zero_is_kept_and_said_to_be_unreliable() -> None:
    out = io.StringIO()
    report = Report("latency", out=out)
    report.rest("polling_other_cpu_ms_per_message", -0.094, "the rest", "ms")
    report.json_line()
    lines = out.getvalue().splitlines()
    assert "-0.094 ms" in lines[0]
    assert "not reliable" in lines[1]
    assert json.loads(lines[-1])["polling_other_cpu_ms_per_message"] == -0.094


def test_a_rest_of_zero_or_more_is_printed_alone() -> None:
    out = io.StringIO()
    Report("saga", out=out).rest("other_cpu_ms_per_saga", 0.782, "the rest", "ms")
    assert out.getvalue().splitlines() == [f"   {'the rest':<46} 0.782 ms"]
