"""State-machine diagrams drawn from the compiled definitions (so they cannot drift from them).

Mermaid (``.mmd``) renders in any Markdown viewer and needs nothing installed; SVG is drawn by
Graphviz when both the ``graphviz`` Python package (extra ``diagrams``) and the ``dot`` program
are present.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

from transitions.extensions.diagrams import GraphMachine

from saga_engine.app import App
from saga_engine.definition import Saga
from saga_engine.machine import STARTED, edges, state_names


class _Drawing:
    """The model a diagram machine needs; it stays in STARTED, where every saga begins."""

    state: str = STARTED


def _graph(saga: Saga[Any], engine: Literal["mermaid", "graphviz"]) -> Any:
    model = _Drawing()
    transitions = [{k: v for k, v in e.items() if k != "conditions"} for e in edges(saga)]
    GraphMachine(
        model=model,
        states=state_names(saga),
        transitions=transitions,
        initial=STARTED,
        auto_transitions=False,
        graph_engine=engine,
        title=saga.name,
        show_state_attributes=False,
    )
    return model.get_graph()  # type: ignore[attr-defined]


def mermaid(saga: Saga[Any]) -> str:
    source: str = _graph(saga, "mermaid").draw(None)
    return source.rstrip() + "\n"


def svg_available() -> bool:
    try:
        import graphviz  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return shutil.which("dot") is not None


def svg(saga: Saga[Any]) -> bytes:
    data: bytes = _graph(saga, "graphviz").draw(None, format="svg", prog="dot")
    return data


def write(app: App, out_dir: Path) -> list[Path]:
    """Write ``<saga>.mmd`` (and ``<saga>.svg`` where Graphviz is installed) for every saga."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in sorted(app.sagas):
        saga = app.sagas[name]
        path = out_dir / f"{name}.mmd"
        path.write_text(mermaid(saga))
        written.append(path)
        if svg_available():
            path = out_dir / f"{name}.svg"
            path.write_bytes(svg(saga))
            written.append(path)
    return written
