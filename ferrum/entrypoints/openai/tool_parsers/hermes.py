"""The hermes tool-call format (Qwen2.5, Qwen3): `{"name": ..., "arguments": {...}}` inside
`<tool_call>` tags. A body starting `{"name": <string>, "arguments": {` streams: the name at once,
the arguments' text up to their closing brace (or the block's end). Other bodies are decided when
the block closes: `arguments` an object, a string holding one, or absent; other keys ignored. Not
one JSON object, no string `name` or non-object arguments: the block is content."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ferrum.entrypoints.openai.tool_parsers.base import (
    StreamedCall,
    ToolParser,
    loads_strict_json,
)

# `{"name": "<name>", "arguments": ` followed by the arguments object's `{`.
_STREAMED_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)'
)


def json_object_end(text: str, start: int) -> int | None:
    """The index just past the brace closing the JSON object that opens at `text[start]`, or
    None if `text` ends first (strings and escapes respected)."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream_call(self, body: str, final: bool) -> StreamedCall | None:
        header = _STREAMED_HEADER.match(body)
        if header is None:
            return None
        try:
            name = json.loads(header.group(1))
        except ValueError:
            return None
        start = header.end()
        end = json_object_end(body, start)
        return StreamedCall(name, body[start:end] if end is not None else body[start:])

    def parse_call(self, body: str) -> tuple[str, dict[str, Any]] | None:
        try:
            call = loads_strict_json(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = loads_strict_json(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return call["name"], arguments

    @classmethod
    def call_format(cls, name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"{cls.START_TAG}\n"
            f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
            "content": {
                "type": "json_schema",
                "json_schema": dict(parameters) or {"type": "object"},
                # Raw tags inside a string would end (or restart) the block for the parser.
                "excludes": [cls.START_TAG, cls.END_TAG],
            },
            "end": f"}}\n{cls.END_TAG}",
        }
