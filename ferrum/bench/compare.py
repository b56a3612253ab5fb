"""Side-by-side table of `bench serve` result files, with ratios vs the first file.

Reads ferrum's and `vllm bench serve`'s JSON results (same field names); a figure a file lacks
shows as "-". `--plot out.png` draws throughput and TTFT/TPOT/ITL percentiles (needs
matplotlib: `pip install -e '.[plot]'` in ferrum's checkout, or `pip install matplotlib`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

THROUGHPUT_ROWS = (
    ("completed", "completed requests"),
    ("failed", "failed requests"),
    ("request_throughput", "requests/s"),
    ("output_throughput", "output tok/s"),
    ("total_token_throughput", "total tok/s"),
    ("request_goodput", "goodput req/s"),
)
LATENCY_ROWS = tuple(
    (f"{stat}_{metric}_ms", f"{stat} {metric.upper()} ms")
    for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "p90", "p99")
)
PLOT_PERCENTILES = ("median", "p90", "p99")
INTEGER_ROWS = frozenset({"completed", "failed"})


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.add_argument("results", nargs="+", help="result JSON files; the first is the baseline")
    parser.add_argument("--labels", nargs="+", default=None, help="column names (default: stems)")
    parser.add_argument("--plot", default=None, help="also write a PNG chart to this path")


def main(args: argparse.Namespace) -> int:
    if args.plot:
        _require_matplotlib()
    results = [load_result(path) for path in args.results]
    labels = args.labels or [Path(p).stem for p in args.results]
    if len(labels) != len(results):
        raise ValueError(f"labels must name each of the {len(results)} results, got {len(labels)}")
    print(format_table(results, labels))
    if args.plot:
        plot_results(results, labels, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def load_result(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"results: {path!r} is not a file")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"results: {path!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict) or "completed" not in data:
        raise ValueError(f"results: {path!r} is not a bench serve result (no 'completed')")
    return data


def format_table(results: list[dict[str, Any]], labels: list[str]) -> str:
    """One row per metric: each file's value and, after the first, its ratio to the first."""
    header = ["metric"]
    for i, label in enumerate(labels):
        header.append(label)
        if i:
            header.append(f"{label}/{labels[0]}")
    rows = [header]
    for key, name in THROUGHPUT_ROWS + LATENCY_ROWS:
        values = [_number(r.get(key)) for r in results]
        if all(v is None for v in values):
            continue
        row = [name]
        for i, value in enumerate(values):
            row.append(_format(value, integer=key in INTEGER_ROWS))
            if i:
                row.append(_ratio(value, values[0]))
        rows.append(row)
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:])
        ]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_results(results: list[dict[str, Any]], labels: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ("ttft", "tpot", "itl")
    fig, axes = plt.subplots(1, 1 + len(metrics), figsize=(4.5 * (1 + len(metrics)), 4))
    width = 0.8 / len(results)
    throughput = [_number(r.get("output_throughput")) or 0.0 for r in results]
    axes[0].bar(range(len(results)), throughput, color=[f"C{i}" for i in range(len(results))])
    axes[0].set_xticks(range(len(results)), labels, rotation=20)
    axes[0].set_title("output throughput")
    axes[0].set_ylabel("tokens/s")
    for ax, metric in zip(axes[1:], metrics):
        for i, (result, label) in enumerate(zip(results, labels)):
            values = [
                _number(result.get(f"{stat}_{metric}_ms")) or 0.0 for stat in PLOT_PERCENTILES
            ]
            positions = [p + i * width for p in range(len(PLOT_PERCENTILES))]
            ax.bar(positions, values, width, label=label, color=f"C{i}")
        ax.set_xticks(
            [p + width * (len(results) - 1) / 2 for p in range(len(PLOT_PERCENTILES))],
            PLOT_PERCENTILES,
        )
        ax.set_title(metric.upper())
        ax.set_ylabel("ms")
    axes[-1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _require_matplotlib() -> None:
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            "plot needs matplotlib, which is not installed: pip install matplotlib (or "
            "pip install -e '.[plot]' in ferrum's checkout)"
        )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _format(value: float | None, integer: bool) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if integer else f"{value:,.2f}"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0:
        return "-"
    return f"{value / base:.2f}x"
