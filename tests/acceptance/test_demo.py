"""The demo, as a user runs it: in-process through ``run_demo`` and as ``saga-engine demo``."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from saga_engine.demo import run_demo

CLI = str(Path(sys.executable).with_name("saga-engine"))


def assert_healthy(report: dict[str, Any], sagas: int, compensated: int) -> None:
    assert report["sagas"] == sagas
    assert (report["failed"], report["stuck"]) == (0, 0)
    assert report["invariants_ok"] is True, report["violations"]
    assert (report["completed"], report["compensated"]) == (sagas - compensated, compensated)
    assert report["sagas_per_s"] > 0


def test_run_demo_in_process_ends_with_one_json_line() -> None:
    out = io.StringIO()
    returned = run_demo(sagas=40, fail_rate=0.2, as_json=True, out=out)

    printed = json.loads(out.getvalue().splitlines()[-1])
    assert printed == returned
    assert_healthy(printed, sagas=40, compensated=8)
    assert printed["injected"] == {"out_of_stock": 4, "card_declined": 4}
    assert printed["db"].startswith("sqlite:///")
    assert not Path(printed["db"].removeprefix("sqlite:///")).exists()  # the temp file is gone


def test_run_demo_prints_a_summary_table() -> None:
    out = io.StringIO()
    run_demo(sagas=10, fail_rate=0.2, out=out)
    text = out.getvalue()
    for label in ("completed", "compensated", "stuck", "sagas/s", "dead letters", "invariants"):
        assert label in text
    assert "all hold" in text


def test_saga_engine_demo_command() -> None:
    done = subprocess.run(
        [CLI, "demo", "--sagas", "40", "--fail-rate", "0.2", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert_healthy(json.loads(done.stdout.splitlines()[-1]), sagas=40, compensated=8)
