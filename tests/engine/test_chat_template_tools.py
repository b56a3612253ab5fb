"""Tools, tool calls and tool results render exactly as transformers renders them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ferrum.engine.tokenizer import Tokenizer
from ferrum.entrypoints.openai.tool_messages import decode_tool_call_arguments
from tests.utils.tokenizer_files import QWEN3_TEMPLATE, build_tokenizer_dir

transformers = pytest.importorskip("transformers")

# The structure of Qwen3-Coder's template: XML tool descriptions, `arguments|items` over each tool
# call's arguments, `loop.previtem`/`loop.nextitem` grouping of tool results, macros.
QWEN3_CODER_TEMPLATE = """{% macro render_extra_keys(json_dict, handled_keys) %}
    {%- if json_dict is mapping %}
        {%- for json_key in json_dict if json_key not in handled_keys %}
            {%- if json_dict[json_key] is mapping
                    or (json_dict[json_key] is sequence and json_dict[json_key] is not string) %}
                {{- '\\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | tojson | safe)
                    ~ '</' ~ json_key ~ '>' }}
            {%- else %}
                {{- '\\n<' ~ json_key ~ '>' ~ (json_dict[json_key] | string)
                    ~ '</' ~ json_key ~ '>' }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{% endmacro %}
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = [] %}
{%- endif %}
{%- if system_message is defined %}
    {{- "<|im_start|>system\\n" + system_message }}
{%- elif tools is iterable and tools | length > 0 %}
    {{- "<|im_start|>system\\nYou are a helpful assistant." }}
{%- endif %}
{%- if tools is iterable and tools | length > 0 %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {%- if tool.function is defined %}
            {%- set tool = tool.function %}
        {%- endif %}
        {{- "\\n<function>\\n<name>" ~ tool.name ~ "</name>" }}
        {%- if tool.description is defined %}
            {{- '\\n<description>' ~ (tool.description | trim) ~ '</description>' }}
        {%- endif %}
        {{- '\\n<parameters>' }}
        {%- if tool.parameters is defined and tool.parameters is mapping
                and tool.parameters.properties is defined
                and tool.parameters.properties is mapping %}
            {%- for param_name, param_fields in tool.parameters.properties|items %}
                {{- '\\n<parameter>\\n<name>' ~ param_name ~ '</name>' }}
                {%- if param_fields.type is defined %}
                    {{- '\\n<type>' ~ (param_fields.type | string) ~ '</type>' }}
                {%- endif %}
                {{- render_extra_keys(param_fields, ['name', 'type']) }}
                {{- '\\n</parameter>' }}
            {%- endfor %}
        {%- endif %}
        {{- render_extra_keys(tool.parameters, ['type', 'properties']) }}
        {{- '\\n</parameters>\\n</function>' }}
    {%- endfor %}
    {{- "\\n</tools>" }}
{%- endif %}
{%- if system_message is defined or (tools is iterable and tools | length > 0) %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined
            and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string
                and message.content | trim | length > 0 %}
            {{- '\\n' + message.content | trim + '\\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\\n' }}
                    {%- set args_value = args_value | tojson | safe
                        if args_value is mapping
                            or (args_value is sequence and args_value is not string)
                        else args_value | string %}
                    {{- args_value }}
                    {{- '\\n</parameter>\\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "user" or message.role == "system" or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user\\n' }}
        {%- endif %}
        {{- '<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>\\n' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "  Current weather for a city, e.g. <Paris> & Zürich  ",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "Città"},
                    "days": {"type": "integer", "minimum": 1},
                    "units": {"type": "string", "enum": ["metric", "imperial"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
                "additionalProperties": False,
            },
        },
    },
]


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An assistant tool call as OpenAI clients send it: arguments as JSON text."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


CONVERSATIONS: list[list[dict[str, Any]]] = [
    [
        {"role": "system", "content": "Use tools when helpful."},
        {"role": "user", "content": "Weather in Paris and Zürich for 2 days?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                _call("call_1", "get_weather", {"city": "Paris", "days": 2}),
                _call("call_2", "get_weather", {"city": "Zürich", "units": "metric"}),
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21, "sky": "clear"}'},
        {"role": "tool", "tool_call_id": "call_2", "content": '{"temp_c": 14}'},
        {"role": "assistant", "content": "Paris: 21°C and clear. Zürich: 14°C."},
        {"role": "user", "content": "Now search for <b>umbrellas</b>."},
    ],
    [
        {"role": "user", "content": "Find docs"},
        {
            "role": "assistant",
            "content": "Let me search.",
            "reasoning_content": "The user wants docs.",
            "tool_calls": [
                _call("call_a", "search", {"query": "docs", "filters": {"lang": ["en", "de"]}})
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "3 results"},
    ],
    [
        {"role": "user", "content": "No tools needed here."},
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "Thanks"},
    ],
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    path: Path = build_tokenizer_dir(tmp_path_factory.mktemp("tools"), chat_template=QWEN3_TEMPLATE)
    return Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("template", [QWEN3_TEMPLATE, QWEN3_CODER_TEMPLATE], ids=["qwen3", "coder"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_tool_conversations_match_transformers(
    tokenizers: tuple[Tokenizer, Any],
    template: str,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> None:
    ours, theirs = tokenizers
    messages = decode_tool_call_arguments(conversation)
    expected = theirs.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    got = ours.apply_chat_template(messages, tools=tools, chat_template=template)
    assert got == expected


def test_qwen3_renders_calls_and_results_in_its_own_syntax(
    tokenizers: tuple[Tokenizer, Any],
) -> None:
    ours, _ = tokenizers
    messages = decode_tool_call_arguments(CONVERSATIONS[0])
    qwen3 = ours.apply_chat_template(messages, tools=TOOLS, chat_template=QWEN3_TEMPLATE)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich", "units": "metric"}}\n</tool_call>'
    ) in qwen3
    assert (
        '<|im_start|>user\n<tool_response>\n{"temp_c": 21, "sky": "clear"}\n</tool_response>\n'
        '<tool_response>\n{"temp_c": 14}\n</tool_response><|im_end|>'
    ) in qwen3
    assert json.dumps(TOOLS[0], ensure_ascii=False) in qwen3
    coder = ours.apply_chat_template(messages, tools=TOOLS, chat_template=QWEN3_CODER_TEMPLATE)
    assert (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
        "<parameter=units>\nmetric\n</parameter>\n</function>\n</tool_call>"
    ) in coder
    assert "<parameter>\n<name>days</name>\n<type>integer</type>\n<minimum>1</minimum>" in coder


def test_decode_tool_call_arguments_leaves_other_messages_and_the_input_alone() -> None:
    conversation = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "tool_calls": [
                _call("a", "f", {"k": [1, 2]}),
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "c", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
            ],
        },
    ]
    snapshot = json.dumps(conversation)
    decoded = decode_tool_call_arguments(conversation)
    assert json.dumps(conversation) == snapshot
    assert decoded[0] == conversation[0]
    calls = decoded[1]["tool_calls"]
    assert calls[0]["function"] == {"name": "f", "arguments": {"k": [1, 2]}}
    assert calls[1]["function"]["arguments"] == "not json"
    assert calls[2]["function"]["arguments"] == "[1]"
