"""OpenAI `tool_choice` to the grammar enforcing it, a structural tag (xgrammar's JSON format) of
call blocks in the parser's own syntax, each block's arguments constrained by its function's
`parameters` schema, so every call parses with the same parser into a call of an allowed function
with valid arguments. "required" or a named function: calls only, newline-separated. "auto": free
text in which a call block's start tag starts a call that must be complete and valid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ferrum.entrypoints.openai.tool_parsers.base import ToolParser, function_definitions

_CHOICE_WORDS = ("none", "auto", "required")


def forced_function_names(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None
) -> list[str] | None:
    """The functions the output must call (one of them, at least once), or None when the model may
    answer in text (`tool_choice` "none", "auto" or absent). Raises ValueError on a choice that
    names no known function."""
    functions = function_definitions(tools)
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        if not functions:
            raise ValueError('tool_choice "required" needs at least one function in tools')
        return list(functions)
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError(
                "tool_choice must be one of "
                f"{', '.join(_CHOICE_WORDS)} or {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        if name not in functions:
            raise ValueError(
                f"tool_choice names function {name!r}, which is not in tools "
                f"({', '.join(functions) or 'none given'})"
            )
        return [name]
    raise ValueError(f"tool_choice must be one of {', '.join(_CHOICE_WORDS)} or a named function")


def tool_call_structural_tag(
    parser: type[ToolParser],
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool = True,
) -> dict[str, Any] | None:
    """The structural tag that makes the output `parser`-syntax calls only, or None when
    `tool_choice` leaves the output free. A named function is called exactly once; "required"
    allows one call, or several when `parallel_tool_calls`."""
    names = forced_function_names(tools, tool_choice)
    if names is None:
        return None
    functions = function_definitions(tools)
    single = len(names) == 1 and tool_choice != "required"
    return {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": [parser.call_format(name, functions[name]) for name in names],
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": single or not parallel_tool_calls,
        },
    }


def auto_tool_call_structural_tag(
    parser: type[ToolParser],
    tools: Sequence[Mapping[str, Any]] | None,
    parallel_tool_calls: bool = True,
) -> dict[str, Any] | None:
    """The structural tag of `tool_choice` "auto": text, in which `parser.START_TAG` opens a call
    to one of `tools` (any number of them, or one without `parallel_tool_calls`: the output then
    ends after it). None without tools."""
    functions = function_definitions(tools)
    if not functions:
        return None
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [parser.START_TAG],
            "tags": [parser.call_format(name, schema) for name, schema in functions.items()],
            "at_least_one": False,
            "stop_after_first": not parallel_tool_calls,
        },
    }
