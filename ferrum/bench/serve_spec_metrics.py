"""`ferrum bench serve`'s speculative-decoding section: the server's spec_decode counters
(`/metrics`, vLLM's names under ferrum's prefix) read before and after the run; their difference
gives the run's drafts, draft tokens, accepted tokens, acceptance rate and length (tokens a
verify step emits: 1 + accepted drafts per draft) and the acceptance by draft position."""

from __future__ import annotations

from typing import Any

PREFIX = "ferrum:spec_decode_"
# Counter names as /metrics writes them (prometheus_client's `_total` suffix).
_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def parse_spec_counters(metrics_text: str) -> dict[str, Any]:
    """The spec_decode counters summed over engines: the three totals and, per draft position,
    its accepted tokens (a list, position 0 first)."""
    counters: dict[str, Any] = dict.fromkeys(_COUNTERS, 0.0)
    per_position: dict[int, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith(PREFIX):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name, _, labels = name_and_labels.partition("{")
        name = name.removeprefix(PREFIX).removesuffix("_total")
        if name == "num_accepted_tokens_per_pos":
            position = int(labels.split('position="')[1].split('"')[0])
            per_position[position] = per_position.get(position, 0.0) + float(value)
        elif name in counters:
            counters[name] += float(value)
    counters["per_position"] = [per_position[p] for p in sorted(per_position)]
    return counters


def spec_decode_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """The run's figures from two readings; None when the run verified no draft."""
    delta = {name: after[name] - before[name] for name in _COUNTERS}
    if delta["num_drafts"] <= 0:
        return None
    positions = after["per_position"]
    earlier = before["per_position"] + [0.0] * (len(positions) - len(before["per_position"]))
    accepted = [a - b for a, b in zip(positions, earlier)]
    return {
        "num_drafts": int(delta["num_drafts"]),
        "draft_tokens": int(delta["num_draft_tokens"]),
        "accepted_tokens": int(delta["num_accepted_tokens"]),
        "acceptance_rate": delta["num_accepted_tokens"] / max(delta["num_draft_tokens"], 1),
        "acceptance_length": 1 + delta["num_accepted_tokens"] / delta["num_drafts"],
        "per_position_acceptance_rate": [a / delta["num_drafts"] for a in accepted],
    }


def format_spec_decode(summary: dict[str, Any]) -> list[str]:
    """The report's lines (the same 60-column layout as the rest)."""
    lines = ["{s:{c}^60}".format(s=" Speculative Decoding ", c="-")]
    for label, value in (
        ("Acceptance rate (%):", f"{100 * summary['acceptance_rate']:.2f}"),
        ("Acceptance length:", f"{summary['acceptance_length']:.2f}"),
        ("Drafts:", summary["num_drafts"]),
        ("Draft tokens:", summary["draft_tokens"]),
        ("Accepted tokens:", summary["accepted_tokens"]),
    ):
        lines.append(f"{label:<44}{value:>16}")
    for position, rate in enumerate(summary["per_position_acceptance_rate"]):
        lines.append(f"{f'Position {position} acceptance rate (%):':<44}{100 * rate:>16.2f}")
    return lines
