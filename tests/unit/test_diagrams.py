"""The committed diagrams are exactly what the definitions produce (regenerate: make diagrams)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from saga_engine import diagram
from sagas.app import app
from tests.conftest import unavailable

DIAGRAMS = Path(__file__).resolve().parents[2] / "diagrams"


@pytest.mark.parametrize("name", sorted(app.sagas))
def test_committed_mermaid_matches_the_definition(name: str) -> None:
    assert (DIAGRAMS / f"{name}.mmd").read_text() == diagram.mermaid(app.sagas[name]), (
        "diagrams/ is stale: run `saga-engine diagram --app sagas.app:app --out diagrams/`"
    )


@pytest.mark.parametrize("name", sorted(app.sagas))
def test_committed_svg_matches_the_definition(name: str) -> None:
    if not diagram.svg_available():
        unavailable("Graphviz unavailable (dot and the graphviz package draw the SVG diagrams)")
    assert (DIAGRAMS / f"{name}.svg").read_bytes() == diagram.svg(app.sagas[name])


def test_the_cli_regenerates_exactly_the_committed_files(tmp_path: Path) -> None:
    if not diagram.svg_available():
        unavailable("Graphviz unavailable (dot and the graphviz package draw the SVG diagrams)")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "saga_engine.cli",
            "diagram",
            "--app",
            "sagas.app:app",
            "--out",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        cwd=DIAGRAMS.parent,
    )
    generated = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    committed = {p.name: p.read_bytes() for p in DIAGRAMS.iterdir()}
    assert generated == committed
