"""A forced tool_choice's output is calls only: a cut-off call's markup never reaches `content`,
whole or streamed; "auto" constrains the arguments of the calls the model opens."""

from __future__ import annotations

import pytest

from ferrum.entrypoints.openai.chat_choices import StreamedChoice, response_choice
from ferrum.entrypoints.openai.chat_output_parser import ChatOutputParser
from ferrum.entrypoints.openai.chat_protocol import ChatCompletionRequest
from ferrum.entrypoints.openai.tool_parsers import HermesToolParser, Qwen3CoderToolParser
from ferrum.entrypoints.openai.tool_parsers.tool_choice import auto_tool_call_structural_tag
from ferrum.outputs import CompletionOutput

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
REQUEST = ChatCompletionRequest.model_validate(
    {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "required"}
)
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
OUTPUTS = {
    "one call": (CALL, 1),
    "a call, then one cut in its header": (CALL + '\n<tool_call>\n{"nam', 1),
    "cut in the header": ('\n<tool_call>\n{"nam', 0),
}


def _parser() -> ChatOutputParser:
    return ChatOutputParser(None, HermesToolParser(TOOLS))


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_forced_calls_leave_no_content(name: str) -> None:
    text, num_calls = OUTPUTS[name]
    finish = "stop" if num_calls else "length"
    completion = CompletionOutput(0, text, [1], finish_reason=finish)
    choice = response_choice(REQUEST, completion, _parser(), False, calls_only=True)
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == num_calls
    assert choice.finish_reason == ("tool_calls" if num_calls else "length")
    # Not forced (auto): the cut-off block is content, as the parser reads it.
    free = response_choice(REQUEST, completion, _parser(), False)
    assert "<tool_call>" in (free.message.content or "") or name == "one call"


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_streamed_forced_calls_send_no_content(name: str) -> None:
    text, num_calls = OUTPUTS[name]
    choice = StreamedChoice(_parser(), single_call=False, calls_only=True)
    arguments = ""
    for i, char in enumerate(text):
        delta = choice.delta(char, finished=i == len(text) - 1)
        assert delta.content is None
        arguments += "".join(c.function.arguments or "" for c in delta.tool_calls or [])
    assert choice.num_calls == num_calls
    assert arguments == ('{"a": 1}' if num_calls else "")


@pytest.mark.parametrize("parser", [HermesToolParser, Qwen3CoderToolParser])
def test_auto_tag_triggers_on_the_start_tag(parser) -> None:
    tag = auto_tool_call_structural_tag(parser, TOOLS, parallel_tool_calls=False)
    assert tag is not None
    fmt = tag["format"]
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == [parser.START_TAG]
    assert fmt["tags"] == [parser.call_format("f", {"type": "object"})]
    assert fmt["stop_after_first"] and not fmt["at_least_one"]
    assert auto_tool_call_structural_tag(parser, []) is None
