"""The sampling flags shared by `ferrum generate` and `ferrum run` (SamplingParams' names)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ferrum.sampling_params import SamplingParams

# flag dest -> SamplingParams field
_FIELDS = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "sampling_seed": "seed",
}


def add_sampling_args(
    parser: argparse.ArgumentParser,
    max_tokens_default: str,
    others_default: str,
    *,
    overrides: dict[str, Any] | None = None,
    from_model: bool = False,
) -> None:
    """Adds the flags, each defaulting to None: the command's own defaults, which the help states
    (`max_tokens_default` for --max-tokens; for the others SamplingParams' default, or the
    command's `overrides`, after "the model's value, else" when `from_model`)."""
    group = parser.add_argument_group(
        "sampling", f"SamplingParams fields; unset ones take {others_default}"
    )
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)} | (overrides or {})

    def default(field: str) -> str:
        prefix = "the model's generation_config.json value, else " if from_model else ""
        return f"(default: {prefix}{defaults[field]})"

    group.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"most tokens to generate per reply (default: {max_tokens_default})",
    )
    group.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"0 = greedy decoding {default('temperature')}",
    )
    group.add_argument("--top-p", type=float, default=None, help=default("top_p"))
    group.add_argument("--top-k", type=int, default=None, help=f"0 = off {default('top_k')}")
    group.add_argument("--min-p", type=float, default=None, help=default("min_p"))
    group.add_argument(
        "--repetition-penalty", type=float, default=None, help=default("repetition_penalty")
    )
    group.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="per-request seed (SamplingParams.seed; default: none, the engine's generator)",
    )


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams keyword arguments the user set on the command line."""
    values = {field: getattr(args, dest) for dest, field in _FIELDS.items()}
    return {field: value for field, value in values.items() if value is not None}
