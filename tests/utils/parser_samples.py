"""Recorded-style model outputs for the output parsers, each with its expected parse.

Each sample is one assistant turn as Qwen3 / Qwen3-Coder write it: optional reasoning, text, and
0-3 tool calls, plus the cases a parser must survive (malformed or cut-off calls, partial tags in
plain text, tags inside reasoning).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


def function_tool(
    name: str, properties: dict[str, Any], required: list[str] | None = None
) -> dict[str, Any]:
    """An OpenAI `tools` entry: a function whose parameters are an object of `properties`."""
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        parameters["required"] = required
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


SEARCH = {
    "query": {"type": "string"},
    "filters": {"type": "object"},
    "limit": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "note": {"type": ["string", "null"]},
}
TOOLS: list[dict[str, Any]] = [
    function_tool(
        "get_weather",
        {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        ["city"],
    ),
    function_tool("search", SEARCH),
    function_tool("get_time", {}),
]


@dataclass(frozen=True)
class Sample:
    name: str
    text: str
    reasoning: str
    content: str
    # (name, arguments): a dict, or the exact text of arguments that are not valid JSON.
    calls: list[tuple[str, dict[str, Any] | str]] = field(default_factory=list)
    starts_in_reasoning: bool = False


def _hermes(name: str, arguments: dict[str, Any]) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


_WEATHER_PARIS = ("get_weather", {"city": "Paris", "days": 2})
_WEATHER_ZURICH = ("get_weather", {"city": "Zürich", "metric": True})
_SEARCH = (
    "search",
    {
        "query": 'a "quoted" {brace} [x] \\ back\nslash </tool_c <tool',
        "filters": {"lang": ["en", "de"], "max": 10, "nested": {"deep": None}},
        "limit": 2.5,
    },
)

HERMES_SAMPLES = [
    Sample(
        "plain-text",
        "The capital of France is Paris. Ünïcode 日本語 😀👍🏽 <b>ok</b> & done.",
        "",
        "The capital of France is Paris. Ünïcode 日本語 😀👍🏽 <b>ok</b> & done.",
    ),
    Sample(
        "reasoning-one-call",
        "<think>\nThe user asks for the weather. I'll call get_weather.\n</think>\n\n"
        + _hermes(*_WEATHER_PARIS),
        "The user asks for the weather. I'll call get_weather.",
        "",
        [_WEATHER_PARIS],
    ),
    Sample(
        "text-two-calls",
        "Let me check both cities.\n" + _hermes(*_WEATHER_PARIS) + "\n" + _hermes(*_WEATHER_ZURICH),
        "",
        "Let me check both cities.",
        [_WEATHER_PARIS, _WEATHER_ZURICH],
    ),
    Sample(
        "reasoning-three-calls",
        "<think>\nThree lookups: weather twice, then a search with tricky text.\n\n</think>\n\n"
        "I'll look these up.\n\n"
        + _hermes(*_WEATHER_PARIS)
        + "\n"
        + _hermes(*_SEARCH)
        + "\n"
        + _hermes("get_time", {})
        + "\n",
        "Three lookups: weather twice, then a search with tricky text.",
        "I'll look these up.",
        [_WEATHER_PARIS, _SEARCH, ("get_time", {})],
    ),
    Sample(
        "malformed-body-is-content",
        'Trying.\n<tool_call>\n{"name": "get_weather" "arguments": {"city": "x"}}'
        "\n</tool_call>\nok",
        "",
        'Trying.\n<tool_call>\n{"name": "get_weather" "arguments": {"city": "x"}}'
        "\n</tool_call>\nok",
    ),
    Sample(
        "started-call-keeps-invalid-arguments-as-written",
        'Trying.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>\nok',
        "",
        "Trying.\nok",
        [("get_weather", '{"city": }')],
    ),
    Sample(
        "cut-off-call-keeps-its-arguments-so-far",
        '<think>\nsearch it\n</think>\n\nSure <tool_call>\n{"name": "search", "arguments": '
        '{"query": "unfinished',
        "search it",
        "Sure",
        [("search", '{"query": "unfinished')],
    ),
    Sample(
        "unclosed-complete-call",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n',
        "",
        "",
        [("get_time", {})],
    ),
    Sample(
        "partial-tags-in-text",
        "Use <tool to call; <tool_cal is not a tag, </tool_call> alone neither, nor <think> here."
        " Trailing <tool_",
        "",
        "Use <tool to call; <tool_cal is not a tag, </tool_call> alone neither, nor <think> here."
        " Trailing <tool_",
    ),
    Sample(
        "starts-in-reasoning",
        "I need the weather first.\n</think>\n\nCalling now.\n" + _hermes(*_WEATHER_ZURICH),
        "I need the weather first.",
        "Calling now.",
        [_WEATHER_ZURICH],
        starts_in_reasoning=True,
    ),
    Sample(
        "text-between-and-after-calls",
        "First:\n"
        + _hermes(*_WEATHER_PARIS)
        + "\nThen some explanation.\n"
        + _hermes("get_weather", {"city": "Oslo"})
        + "\nDone. ",
        "",
        "First:\nThen some explanation.\nDone. ",
        [_WEATHER_PARIS, ("get_weather", {"city": "Oslo"})],
    ),
    Sample(
        "call-inside-unclosed-reasoning",
        "<think>\nMaybe " + _hermes(*_WEATHER_PARIS) + " then stop   \n",
        "Maybe " + _hermes(*_WEATHER_PARIS) + " then stop",
        "",
    ),
    Sample(
        "string-arguments-and-restart",
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
        "<tool_call>{broken\n" + _hermes("get_time", {}),
        "",
        "<tool_call>{broken",
        [("search", {"query": "x"}), ("get_time", {})],
    ),
]


def _coder(name: str, parameters: list[tuple[str, str]]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


_CODE = 'def f(x):\n    return x < 3 and x > 1  # "&" <b>\n'
QWEN3_CODER_SAMPLES = [
    Sample(
        "reasoning-typed-call",
        "<think>\nCall the weather tool with days and metric.\n</think>\n\n"
        + _coder("get_weather", [("city", "Paris"), ("days", "3"), ("metric", "False")]),
        "Call the weather tool with days and metric.",
        "",
        [("get_weather", {"city": "Paris", "days": 3, "metric": False})],
    ),
    Sample(
        "text-two-calls-multiline-values",
        "I'll search twice.\n"
        + _coder("search", [("query", _CODE), ("limit", "10"), ("tags", '["a", "b"]')])
        + "\n"
        + _coder("search", [("query", "  spaced  "), ("filters", '{"lang": "en"}')]),
        "",
        "I'll search twice.",
        [
            ("search", {"query": _CODE, "limit": 10, "tags": ["a", "b"]}),
            ("search", {"query": "  spaced  ", "filters": {"lang": "en"}}),
        ],
    ),
    Sample(
        "three-calls",
        _coder("get_weather", [("city", "Zürich")])
        + "\n"
        + _coder("get_time", [])
        + "\n"
        + _coder("search", [("query", "x"), ("note", "null"), ("limit", "0.5")]),
        "",
        "",
        [
            ("get_weather", {"city": "Zürich"}),
            ("get_time", {}),
            ("search", {"query": "x", "note": None, "limit": 0.5}),
        ],
    ),
    Sample(
        "unknown-function-keeps-text",
        _coder("unknown_tool", [("n", "5"), ("flag", "true")]),
        "",
        "",
        [("unknown_tool", {"n": "5", "flag": "true"})],
    ),
    Sample(
        "stray-text-in-function-ends-its-parameters",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\nstray text\n"
        "<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>",
        "",
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    Sample(
        "no-function-tag-is-content",
        "<tool_call>\nstray <function=get_weather>\n</function>\n</tool_call>",
        "",
        "<tool_call>\nstray <function=get_weather>\n</function>\n</tool_call>",
    ),
    Sample(
        "missing-parameter-close",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n4\n"
        "</function>\n</tool_call>",
        "",
        "",
        [("get_weather", {"city": "Oslo", "days": 4})],
    ),
    Sample(
        "unconvertible-values-stay-text",
        _coder("get_weather", [("city", "Rome"), ("days", "two"), ("metric", "maybe")]),
        "",
        "",
        [("get_weather", {"city": "Rome", "days": "two", "metric": "maybe"})],
    ),
    Sample(
        "no-calls-inline-function-text",
        "<think>\nNo tool needed.\n</think>\n\nWrite <function=f> or <parameter=x> in docs; "
        "<tool_ is fine.",
        "No tool needed.",
        "Write <function=f> or <parameter=x> in docs; <tool_ is fine.",
    ),
    Sample(
        "cut-off-call-keeps-its-parameters-so-far",
        "Searching.\n<tool_call>\n<function=search>\n<parameter=query>\nhello wor",
        "",
        "Searching.",
        [("search", {"query": "hello wor"})],
    ),
    Sample(
        "starts-in-reasoning-call-then-text",
        "weather please\n</think>\n\n"
        + _coder("get_weather", [("city", "Lyon"), ("days", "1")])
        + "\nAfter the call.",
        "weather please",
        "\nAfter the call.",
        [("get_weather", {"city": "Lyon", "days": 1})],
        starts_in_reasoning=True,
    ),
]
