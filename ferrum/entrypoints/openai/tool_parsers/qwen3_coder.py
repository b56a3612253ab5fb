"""The qwen3_coder tool-call format (Qwen3-Coder, Qwen3.5): XML with one element per parameter.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags less one newline on each side. It becomes the type its
function's parameter schema names: `string` stays text; `integer`, `number`, `boolean`, `null`,
`object` and `array` are parsed as JSON (booleans case-insensitively) and kept as text when they do
not parse as that type; an `enum`/`const` value is the member it spells (blanks around it
ignored), else text. Parameters the schema does not know, and functions not in `tools`, keep
text values. Accepted: a missing `</parameter>` (the next `<parameter=` or `</function>` closes it).
Refused (the block stays content): no `<function=NAME>` or no `</function>` (a cut-off call), text
outside the parameter elements. A value cannot contain the text `<parameter=` or `</parameter>`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrum.entrypoints.openai.tool_parsers.base import (
    GRAMMAR_MAX_WHITESPACE,
    ToolParser,
    loads_strict_json,
)

_FUNCTION_OPEN = "<function="
_FUNCTION_CLOSE = "</function>"
_PARAMETER_OPEN = "<parameter="
_PARAMETER_CLOSE = "</parameter>"
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


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def parse_call(self, body: str) -> tuple[str, dict[str, Any]] | None:
        text = body.strip()
        if not text.startswith(_FUNCTION_OPEN):
            return None
        name_end = text.find(">")
        name = text[len(_FUNCTION_OPEN) : name_end].strip() if name_end >= 0 else ""
        if not name or "\n" in name or "<" in name:
            return None
        rest = text[name_end + 1 :]
        if not rest.endswith(_FUNCTION_CLOSE):
            return None
        rest = rest[: -len(_FUNCTION_CLOSE)]
        properties = self.functions.get(name, {}).get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        arguments: dict[str, Any] = {}
        at = 0
        while True:
            while at < len(rest) and rest[at].isspace():
                at += 1
            if at == len(rest):
                return name, arguments
            if not rest.startswith(_PARAMETER_OPEN, at):
                return None
            name_end = rest.find(">", at)
            if name_end < 0:
                return None
            parameter = rest[at + len(_PARAMETER_OPEN) : name_end].strip()
            if not parameter or "\n" in parameter:
                return None
            value_start = name_end + 1
            close = rest.find(_PARAMETER_CLOSE, value_start)
            following = rest.find(_PARAMETER_OPEN, value_start)
            if close >= 0 and (following < 0 or close < following):
                value_end, at = close, close + len(_PARAMETER_CLOSE)
            else:
                value_end = at = following if following >= 0 else len(rest)
            value = _strip_one_newline(rest[value_start:value_end])
            arguments[parameter] = convert_parameter(value, properties.get(parameter))

    @classmethod
    def call_format(cls, name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"{cls.START_TAG}\n{_FUNCTION_OPEN}{name}>\n",
            "content": {
                "type": "json_schema",
                "json_schema": dict(parameters) or {"type": "object"},
                "max_whitespace_cnt": GRAMMAR_MAX_WHITESPACE,
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
