"""Per-request records of `ferrum bench serve` and their summary, in `vllm bench serve`'s field
names (`completed`, `failed`, `mean_ttft_ms`, `p99_itl_ms`, ...; times in the summary are ms).

TTFT is the time to the first chunk with content; ITL the gaps between content chunks;
TPOT = (E2EL - TTFT) / (output tokens - 1), over requests with more than one output token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferrum.bench.serve_spec_metrics import format_spec_decode

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
SUMMARY_PERCENTILES = (50, 90, 99)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestRecord:
    """One request's outcome; times in seconds. A failed request has `error` set."""

    prompt_len: int
    success: bool = False
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        name, sep, value = spec.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"goodput entries must be METRIC:MS with METRIC one of {GOODPUT_METRICS}, "
                f"got {spec!r}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput {name} must be a number of ms, got {value!r}") from None
        if not ms > 0 or ms == float("inf"):
            raise ValueError(f"goodput {name} must be a finite number of ms > 0, got {value!r}")
        slos[name] = ms
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": record.ttft * 1e3, "e2el": record.latency * 1e3}
    tpot = record.tpot
    values_ms["tpot"] = 0.0 if tpot is None else tpot * 1e3
    return record.success and all(values_ms[name] <= limit for name, limit in slos.items())


def summarize(
    records: list[RequestRecord], duration: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """The summary dict (vLLM's keys) plus the per-request arrays `input_lens`, `output_lens`,
    `ttfts`, `itls`, `errors` (seconds; failed requests have 0 / [] and their error)."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    done = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in records)
        result["request_goodput"] = good / duration
    else:
        result["request_goodput"] = None
    # The same figure under the `--goodput` flag's name.
    result["goodput"] = result["request_goodput"]
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    for name in LATENCY_METRICS:
        result.update(_latency_stats(name, samples[name]))
    result["input_lens"] = [r.prompt_len for r in records]
    result["output_lens"] = [r.output_len for r in records]
    result["ttfts"] = [r.ttft for r in records]
    result["itls"] = [r.itl for r in records]
    result["errors"] = [r.error for r in records]
    return result


def _latency_stats(name: str, seconds: list[float]) -> dict[str, float]:
    values = np.asarray(seconds, dtype=np.float64) * 1e3 if seconds else np.zeros(1)
    stats = {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(values.std()),
    }
    for p in SUMMARY_PERCENTILES:
        stats[f"p{p}_{name}_ms"] = float(np.percentile(values, p))
    return stats


_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def format_summary(result: dict[str, Any]) -> str:
    """The human-readable report printed after a run."""
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<44}{value:>16{fmt}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for name in LATENCY_METRICS:
        lines.append("{s:{c}^60}".format(s=f" {_TITLES[name]} ", c="-"))
        row(f"Mean {name.upper()} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {name.upper()} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in SUMMARY_PERCENTILES[1:]:
            row(f"P{p} {name.upper()} (ms):", result[f"p{p}_{name}_ms"], ".2f")
    if result.get("spec_decode"):
        lines.extend(format_spec_decode(result["spec_decode"]))
    errors = [e for e in result["errors"] if e]
    if errors:
        lines.append("{s:{c}^60}".format(s=" Errors (first 5 distinct) ", c="-"))
        for error in list(dict.fromkeys(errors))[:5]:
            lines.append(error[:200])
    lines.append("=" * 60)
    return "\n".join(lines)
