"""Turn the ``--json`` output of ``saga-engine bench ...`` runs into one chart (docs/benchmarks.png).

    saga-engine bench relay --json   > relay.txt
    saga-engine bench saga --peer temporal --json > saga.txt
    saga-engine bench latency --json > latency.txt
    saga-engine bench memory --json  > memory.txt
    python scripts/plot_benchmarks.py relay.txt saga.txt latency.txt memory.txt

Each file may hold a whole run's output: the last line that parses as a JSON object with a
``bench`` key is used. Panels are drawn for the benchmarks given; needs matplotlib (the ``bench``
extra).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.png"


def load(path: Path) -> dict[str, Any]:
    """The last JSON object with a ``bench`` key in ``path``."""
    for line in reversed(path.read_text().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict) and "bench" in data:
                return data
    raise SystemExit(f"{path}: no JSON line from saga-engine bench --json")


def bars(ax: Any, labels: list[str], values: list[float], title: str, unit: str) -> None:
    shown = [0.0 if v is None or math.isnan(v) else v for v in values]
    rects = ax.bar(
        labels, shown, color=["#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974"][: len(labels)]
    )
    for rect, value in zip(rects, shown, strict=True):
        ax.annotate(
            f"{value:,.0f}" if value >= 100 else f"{value:.3g}",
            (rect.get_x() + rect.get_width() / 2, rect.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    ax.tick_params(axis="x", labelsize=8)


def relay_panel(ax: Any, d: dict[str, Any]) -> None:
    on_sent = d.get("on_sent", "mark")
    # The database ceiling does what the relay does with a sent row: marks it or deletes it.
    labels = [f"db claim\n+{on_sent}", "relay\nno broker", "raw\nproducer", "relay\n(Kafka)"]
    keys = ["db_claim_mark_rate", "null_relay_rate", "raw_producer_rate", "relay_rate"]
    bars(
        ax,
        labels,
        [d.get(k, math.nan) for k in keys],
        f"relay, {d['messages']:,} msgs, K={d['relays']}, on_sent={on_sent}:"
        f" relay/raw = {d.get('relay_vs_raw_producer', math.nan):.2f}",
        "messages/s",
    )


def saga_panel(ax: Any, d: dict[str, Any]) -> None:
    labels, values = ["saga-engine"], [d.get("sagas_per_s", math.nan)]
    if "temporal_sagas_per_s" in d:
        labels.append("Temporal\n(in memory)")
        values.append(d["temporal_sagas_per_s"])
    ratio = f": {d['vs_temporal']:.1f}x Temporal" if "vs_temporal" in d else ""
    # sagas.order_fulfilment (the full example) or sagas.order_outline (the peer's outline)
    name = str(d.get("saga", "sagas.order_fulfilment")).rsplit(".", 1)[-1]
    bars(ax, labels, values, f"{name}, {d['sagas']:,} sagas, K={d['workers']}{ratio}", "sagas/s")


def latency_panel(ax: Any, d: dict[str, Any]) -> None:
    labels = ["NOTIFY p50", "NOTIFY p99", "polling p50", "polling p99"]
    keys = ["notify_p50_ms", "notify_p99_ms", "polling_p50_ms", "polling_p99_ms"]
    bars(
        ax,
        labels,
        [d.get(k, math.nan) for k in keys],
        f"commit -> ack at {d['rate']:,.0f} msg/s offered",
        "ms",
    )
    ax.set_yscale("log")


def memory_panel(ax: Any, d: dict[str, Any]) -> None:
    labels = ["idle", f"{d['sagas']:,} in flight", "peak"]
    values = [
        d.get("idle_rss_mb", math.nan),
        d.get("final_rss_mb", math.nan),
        d.get("peak_rss_mb", math.nan),
    ]
    bars(ax, labels, values, "worker RSS (target < 200 MiB)", "MiB")
    ax.axhline(200, color="grey", linestyle="--", linewidth=1)


PANELS = {
    "relay": relay_panel,
    "saga": saga_panel,
    "latency": latency_panel,
    "memory": memory_panel,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "files", nargs="+", type=Path, help="outputs of saga-engine bench ... --json"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--title", default="saga-engine benchmarks")
    args = parser.parse_args(argv)
    runs = [load(path) for path in args.files]
    runs = [run for run in runs if run["bench"] in PANELS]
    if not runs:
        raise SystemExit("nothing to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(3, len(runs))
    rows = -(-len(runs) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 4.0 * rows), squeeze=False)
    cells = [ax for row in axes for ax in row]
    for ax, run in zip(cells, runs, strict=False):
        PANELS[run["bench"]](ax, run)
    for ax in cells[len(runs) :]:
        ax.axis("off")
    figure.suptitle(args.title, fontsize=12)
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=120)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
