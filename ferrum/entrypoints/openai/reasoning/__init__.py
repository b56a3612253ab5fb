"""Reasoning parsers by name (`--reasoning-parser`); see base.py for the contract they share."""

from __future__ import annotations

from ferrum.entrypoints.openai.reasoning.base import ReasoningDelta, ReasoningParser
from ferrum.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser,)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as `name`; a ValueError lists the supported names."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(
            f"reasoning_parser {name!r} is not supported; "
            f"supported: {', '.join(sorted(REASONING_PARSERS))}"
        )
    return parser


__all__ = [
    "REASONING_PARSERS",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "get_reasoning_parser",
]
