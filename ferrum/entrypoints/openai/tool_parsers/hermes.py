"""The hermes tool-call format (Qwen2.5, Qwen3): a JSON object inside `<tool_call>` tags.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Accepted: any whitespace around the object; `arguments` as an object, as a string holding a JSON
object, or absent (no arguments); other keys are ignored. Refused (the block stays content): a body
that is not one JSON object, a missing or non-string `name`, arguments that are not an object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ferrum.entrypoints.openai.tool_parsers.base import (
    GRAMMAR_MAX_WHITESPACE,
    ToolParser,
    loads_strict_json,
)


class HermesToolParser(ToolParser):
    name = "hermes"

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
            "begin": f'{cls.START_TAG}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ',
            "content": {
                "type": "json_schema",
                "json_schema": dict(parameters) or {"type": "object"},
                "max_whitespace_cnt": GRAMMAR_MAX_WHITESPACE,
                # Raw tags inside a string would end (or restart) the block for the parser.
                "excludes": [cls.START_TAG, cls.END_TAG],
            },
            "end": f"}}\n{cls.END_TAG}",
        }
