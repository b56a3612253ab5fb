"""OpenAI chat messages with tool calls, in the form chat templates expect.

On the wire an assistant tool call's `function.arguments` is JSON text; chat templates (and
transformers' documentation) take a dict, and some iterate over it (`arguments|items`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def _decoded_call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = call["function"]
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return call  # not JSON: the template gets the text as sent
    if not isinstance(decoded, dict):
        return call
    return {**call, "function": {**function, "arguments": decoded}}


def decode_tool_call_arguments(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `messages` whose assistant tool calls carry `arguments` as a dict where the text
    is a JSON object; everything else is unchanged (and the caller's messages are not modified)."""
    result: list[dict[str, Any]] = []
    for message in messages:
        copy = dict(message)
        calls = copy.get("tool_calls")
        if isinstance(calls, list | tuple):
            copy["tool_calls"] = [_decoded_call(call) for call in calls]
        result.append(copy)
    return result
