from __future__ import annotations

import json
from typing import Any

import pytest

from ferrum.entrypoints.openai.tool_parsers import Qwen3CoderToolParser
from ferrum.entrypoints.openai.tool_parsers.qwen3_coder import convert_parameter

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"s": {"type": "string"}, "n": {"type": "integer"}},
            },
        },
    }
]


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("42", {"type": "string"}, "42"),
        ("42", {"type": "integer"}, 42),
        ("4.0", {"type": "integer"}, 4),
        ("4.5", {"type": "integer"}, "4.5"),
        ("4.5", {"type": "number"}, 4.5),
        ("7", {"type": "number"}, 7),
        ("true", {"type": "integer"}, "true"),
        ("True", {"type": "boolean"}, True),
        ("FALSE", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ("null", {"type": ["string", "null"]}, None),
        ("null", {"type": "string"}, "null"),
        ("hello", {"type": ["string", "null"]}, "hello"),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ('{"a": 1}', {"properties": {"a": {}}}, {"a": 1}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ("3", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 3),
        ("NaN", {"type": "number"}, "NaN"),
        (" 5 ", {"type": "integer"}, 5),
        ("\rslow ", {"enum": ["fast", "slow"]}, "slow"),
        ("slow", {"type": "string", "enum": ["slow"]}, "slow"),
        ("3", {"enum": ["3", 3]}, "3"),
        (" 3", {"enum": [1, 3]}, 3),
        ("true", {"const": True}, True),
        ("4", {"enum": [1, 3]}, "4"),
        ("5", None, "5"),
        ("5", {}, "5"),
    ],
)
def test_convert_parameter(value: str, schema: Any, expected: Any) -> None:
    got = convert_parameter(value, schema)
    assert got == expected and type(got) is type(expected)


def _calls(text: str) -> tuple[str, list[tuple[str, object]]]:
    content, calls = Qwen3CoderToolParser(TOOLS).extract_tool_calls(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_values_lose_one_newline_each_side_only() -> None:
    text = (
        "<tool_call>\n<function=f>\n<parameter=s>\n\n two\nlines \n\n</parameter>\n"
        "<parameter=n>7</parameter></function>\n</tool_call>"
    )
    assert _calls(text) == ("", [("f", {"s": "\n two\nlines \n", "n": 7})])


@pytest.mark.parametrize(
    "body",
    [
        "<function=>\n</function>",
        "<function=f\n</function>",
        "junk <function=f>\n</function>",
    ],
)
def test_blocks_without_a_function_tag_stay_content(body: str) -> None:
    text = f"x<tool_call>\n{body}\n</tool_call>"
    assert _calls(text) == (text, [])


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ("<function=f>\n<parameter=s>\nx\n</parameter>\n", {"s": "x"}),  # no </function>
        ("<function=f>\ntext\n</function>", {}),
        ("<function=f>\n<parameter=>\nx\n</parameter>\n</function>", {}),
        ("<function=f>\n<parameter=s\n</function>", {}),
        ("<function=f>\n<parameter=a>\n1\n</parameter>\njunk\n<parameter=b>\n2", {"a": "1"}),
    ],
)
def test_a_started_call_keeps_the_parameters_it_finished(body: str, arguments: dict) -> None:
    assert _calls(f"x<tool_call>\n{body}\n</tool_call>") == ("x", [("f", arguments)])


def test_arguments_stream_one_parameter_at_a_time() -> None:
    text = (
        "<tool_call>\n<function=f>\n<parameter=s>\nParis\n</parameter>\n"
        "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    parser = Qwen3CoderToolParser(TOOLS)
    deltas = []
    for char in text:
        deltas += parser.extract_tool_calls_streaming(char).tool_calls
    deltas += parser.finish().tool_calls
    assert (deltas[0].name, deltas[0].arguments) == ("f", "")
    assert [d.arguments for d in deltas[1:]] == ['{"s": "Paris"', ', "n": 3', "}"]
    assert Qwen3CoderToolParser(TOOLS).extract_tool_calls(text)[1][0].arguments == (
        '{"s": "Paris", "n": 3}'
    )


def test_call_format_is_the_syntax_the_parser_reads() -> None:
    fmt = Qwen3CoderToolParser.call_format("f", {"type": "object"})
    text = fmt["begin"] + "<parameter=n>\n3\n</parameter>\n" + fmt["end"]
    assert _calls(text) == ("", [("f", {"n": 3})])
