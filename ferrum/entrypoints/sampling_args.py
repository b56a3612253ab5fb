"""The sampling flags shared by `ferrum generate` and `ferrum run` (SamplingParams' names)."""

from __future__ import annotations

import argparse
from typing import Any

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
    parser: argparse.ArgumentParser, max_tokens_default: str, others_default: str
) -> None:
    """Adds the flags, each defaulting to None: the command's own defaults, which the help states
    (`max_tokens_default` for --max-tokens, `others_default` for the other fields)."""
    group = parser.add_argument_group(
        "sampling", f"SamplingParams fields; unset ones take {others_default}"
    )
    group.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"most tokens to generate per reply (default: {max_tokens_default})",
    )
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy decoding")
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=None)
    group.add_argument("--repetition-penalty", type=float, default=None)
    group.add_argument(
        "--sampling-seed", type=int, default=None, help="per-request seed (SamplingParams.seed)"
    )


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams keyword arguments the user set on the command line."""
    values = {field: getattr(args, dest) for dest, field in _FIELDS.items()}
    return {field: value for field, value in values.items() if value is not None}
