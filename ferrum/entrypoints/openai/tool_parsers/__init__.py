"""Tool-call parsers by name (`--tool-call-parser`); see base.py for the contract they share."""

from __future__ import annotations

from ferrum.entrypoints.openai.tool_parsers.base import (
    DeltaToolCall,
    ToolCall,
    ToolCallsDelta,
    ToolParser,
)
from ferrum.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from ferrum.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Qwen3CoderToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; a ValueError lists the supported names."""
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(
            f"tool_call_parser {name!r} is not supported; "
            f"supported: {', '.join(sorted(TOOL_PARSERS))}"
        )
    return parser


__all__ = [
    "TOOL_PARSERS",
    "DeltaToolCall",
    "HermesToolParser",
    "Qwen3CoderToolParser",
    "ToolCall",
    "ToolCallsDelta",
    "ToolParser",
    "get_tool_parser",
]
