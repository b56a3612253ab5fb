"""The qwen3_coder tool-call format (Qwen3-Coder, Qwen3.5): XML, one element per parameter:
`<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`.
A value is the text between its tags less one blank each side (a newline from trained models; the
grammar allows one blank of any kind there), typed by its parameter schema
(`string` stays text; other JSON types parse as JSON, booleans case-insensitively, else stay text;
`enum`/`const` values the member they spell); unknown parameters or functions keep text. A missing
`</parameter>` is accepted; a value cannot contain `<parameter=` or `</parameter>`. Streaming: a
block is a call once `<function=NAME>` is complete; then the arguments go out as JSON, one
parameter at a time (`{"a": 1`, `, "b": "x"`, `}`). Other blocks are content."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ferrum.entrypoints.openai.tool_parsers.base import (
    StreamedCall,
    ToolParser,
    loads_strict_json,
)

_FUNCTION_OPEN = "<function="
_FUNCTION_CLOSE = "</function>"
_PARAMETER_OPEN = "<parameter="
_PARAMETER_CLOSE = "</parameter>"
_BLANKS = (" ", "\t", "\r", "\n")  # not "": a value may be empty
_JSON_TYPES = {
    "null": type(None),
    "boolean": bool,
    "integer": int,
    "number": (int, float),
    "object": dict,
    "array": list,
}


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows, in the order given (`anyOf`/`oneOf` included)."""
    if not isinstance(schema, Mapping):
        return []
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            types += [t for t in _schema_types(option) if t not in types]
    if not types and ("properties" in schema):
        types = ["object"]
    return [t for t in types if isinstance(t, str)]


def _schema_choices(schema: Any) -> list[Any] | None:
    """The values an `enum` or `const` schema allows, or None."""
    if not isinstance(schema, Mapping):
        return None
    if "const" in schema:
        return [schema["const"]]
    choices = schema.get("enum")
    return list(choices) if isinstance(choices, list) else None


def convert_parameter(value: str, schema: Any) -> Any:
    """`value` as the JSON type `schema` asks for; text when it names none or the value does not
    parse as any of them."""
    text = value.strip()
    choices = _schema_choices(schema)
    if choices is not None:
        # Blanks around an enum member are layout (the grammar allows them), not part of it.
        if text in choices:
            return text
        try:
            parsed = loads_strict_json(text)
        except ValueError:
            return value
        return parsed if any(parsed == c and type(parsed) is type(c) for c in choices) else value
    types = _schema_types(schema)
    if not types or types == ["string"]:
        return value
    for json_type in types:
        if json_type == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        expected = _JSON_TYPES.get(json_type)
        if expected is None:
            continue
        try:
            parsed = loads_strict_json(text)
        except ValueError:
            continue
        if isinstance(parsed, bool) and json_type != "boolean":
            continue
        if isinstance(parsed, expected):
            return parsed
        if json_type == "integer" and isinstance(parsed, float) and parsed.is_integer():
            return int(parsed)
    return value


def _finished_parameters(rest: str, final: bool) -> list[tuple[str, str]]:
    """The (name, raw value) of each parameter element of a call's `rest` (after
    `<function=NAME>`) that has ended: at its `</parameter>`, the next `<parameter=` or
    `</function>`, or, when `final`, the end of the block. Stops at `</function>` and at text
    outside the elements."""
    parameters: list[tuple[str, str]] = []
    at = 0
    while True:
        while at < len(rest) and rest[at].isspace():
            at += 1
        if not rest.startswith(_PARAMETER_OPEN, at):
            return parameters  # the end, `</function>`, other text, or a tag still arriving
        name_end = rest.find(">", at)
        if name_end < 0:
            return parameters
        parameter = rest[at + len(_PARAMETER_OPEN) : name_end].strip()
        if not parameter or "\n" in parameter:
            return parameters
        value_start = name_end + 1
        ends = [
            (found, found + len(tag) if tag == _PARAMETER_CLOSE else found)
            for tag in (_PARAMETER_CLOSE, _PARAMETER_OPEN, _FUNCTION_CLOSE)
            if (found := rest.find(tag, value_start)) >= 0
        ]
        if ends:
            value_end, at = min(ends)
        elif final:
            value_end = at = len(rest)
        else:
            return parameters  # its value may go on
        parameters.append((parameter, _strip_one_blank(rest[value_start:value_end])))


def _strip_one_blank(value: str) -> str:
    if value[:1] in _BLANKS:
        value = value[1:]
    if value[-1:] in _BLANKS:
        value = value[:-1]
    return value


def _json_member(key: str, value: Any) -> str:
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def stream_call(self, body: str, final: bool) -> StreamedCall | None:
        text = body.lstrip()
        if not text.startswith(_FUNCTION_OPEN):
            return None
        name_end = text.find(">")
        if name_end < 0:
            return None
        name = text[len(_FUNCTION_OPEN) : name_end].strip()
        if not name or "\n" in name or "<" in name:
            return None
        properties = self.functions.get(name, {}).get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        members = [
            _json_member(parameter, convert_parameter(value, properties.get(parameter)))
            for parameter, value in _finished_parameters(text[name_end + 1 :], final)
        ]
        arguments = "{" + ", ".join(members) if members else ""
        if final:
            arguments = (arguments or "{") + "}"
        return StreamedCall(name, arguments)

    def parse_call(self, body: str) -> tuple[str, dict[str, Any]] | None:
        """Never a call: every call starts with `<function=NAME>`, which `stream_call` takes."""
        return None

    @classmethod
    def call_format(cls, name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"{cls.START_TAG}\n{_FUNCTION_OPEN}{name}>\n",
            "content": {
                "type": "json_schema",
                "json_schema": dict(parameters) or {"type": "object"},
                "style": "qwen_xml",
                # Raw tags inside a value would end (or split) the value or block for the parser.
                "excludes": [
                    cls.START_TAG,
                    cls.END_TAG,
                    _FUNCTION_CLOSE,
                    _PARAMETER_OPEN,
                    _PARAMETER_CLOSE,
                ],
            },
            "end": f"{_FUNCTION_CLOSE}\n{cls.END_TAG}",
        }
