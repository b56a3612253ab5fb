"""Chat choices built from model output: whole, and streamed in any split, agree exactly."""

from __future__ import annotations

import json
import random

import pytest

from ferrum.entrypoints.openai.chat_choices import StreamedChoice, response_choice
from ferrum.entrypoints.openai.chat_output_parser import ChatOutputParser
from ferrum.entrypoints.openai.chat_protocol import ChatCompletionRequest
from ferrum.entrypoints.openai.reasoning import Qwen3ReasoningParser
from ferrum.entrypoints.openai.tool_parsers import HermesToolParser
from ferrum.outputs import CompletionOutput

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
REQUEST = ChatCompletionRequest.model_validate(
    {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
)
OUTPUTS = [
    "plain answer, no tags",
    "<think>\nweigh it\n</think>\n\nThe answer.",
    '<think>ok</think>\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
    '{"zone": "CET"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": ',  # cut off: content
]


def parser() -> ChatOutputParser:
    return ChatOutputParser(Qwen3ReasoningParser(), HermesToolParser(TOOLS))


def stream(text: str, pieces: list[str], single_call: bool = False) -> dict:
    """The streamed deltas of `text`, reassembled as an OpenAI client does."""
    choice = StreamedChoice(parser(), single_call)
    message: dict = {"content": "", "reasoning_content": "", "tool_calls": []}
    for i, piece in enumerate(pieces):
        delta = choice.delta(piece, finished=i == len(pieces) - 1)
        message["content"] += delta.content or ""
        message["reasoning_content"] += delta.reasoning_content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(message["tool_calls"])
                assert call.type == "function" and call.function is not None
                message["tool_calls"].append(
                    {"id": call.id, "name": call.function.name, "arguments": ""}
                )
            assert call.function is not None
            message["tool_calls"][call.index]["arguments"] += call.function.arguments or ""
    message["num_calls"] = choice.num_calls
    return message


def whole(text: str, single_call: bool = False) -> dict:
    completion = CompletionOutput(0, text, [1], finish_reason="stop")
    choice = response_choice(REQUEST, completion, parser(), single_call)
    return {
        "content": choice.message.content or "",
        "reasoning_content": choice.message.reasoning_content or "",
        "tool_calls": [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls
        ],
        "finish_reason": choice.finish_reason,
    }


def without_ids(message: dict) -> dict:
    return {**message, "tool_calls": [{**c, "id": None} for c in message["tool_calls"]]}


def random_split(text: str, rng: random.Random) -> list[str]:
    pieces, at = [], 0
    while at < len(text):
        size = rng.randint(1, 6)
        pieces.append(text[at : at + size])
        at += size
    return pieces or [""]


@pytest.mark.parametrize("text", OUTPUTS)
def test_every_split_of_a_stream_reassembles_to_the_whole_response(text: str) -> None:
    expected = without_ids(whole(text))
    rng = random.Random(0)
    for _ in range(50):
        streamed = stream(text, random_split(text, rng))
        assert streamed.pop("num_calls") == len(expected["tool_calls"])
        assert without_ids(streamed) == {k: v for k, v in expected.items() if k != "finish_reason"}


def test_calls_are_split_from_reasoning_and_content() -> None:
    message = whole(OUTPUTS[2])
    assert message["reasoning_content"] == "ok"
    assert message["content"] == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert all(c["id"].startswith("call_") for c in message["tool_calls"])
    assert message["finish_reason"] == "tool_calls"
    assert whole(OUTPUTS[1])["finish_reason"] == "stop"


def test_only_calls_leave_content_null() -> None:
    completion = CompletionOutput(0, OUTPUTS[3], [1], finish_reason="stop")
    choice = response_choice(REQUEST, completion, parser(), single_call=False)
    assert choice.message.content is None
    assert choice.message.reasoning_content is None


def test_parallel_tool_calls_false_keeps_the_first_call_only() -> None:
    assert [c["name"] for c in whole(OUTPUTS[2], single_call=True)["tool_calls"]] == ["get_weather"]
    streamed = stream(OUTPUTS[2], list(OUTPUTS[2]), single_call=True)
    assert [c["name"] for c in streamed["tool_calls"]] == ["get_weather"]
    assert streamed["num_calls"] == 1


def test_a_length_cut_keeps_its_finish_reason() -> None:
    completion = CompletionOutput(0, OUTPUTS[3], [1], finish_reason="length")
    choice = response_choice(REQUEST, completion, parser(), single_call=False)
    assert choice.finish_reason == "length"
    assert len(choice.message.tool_calls) == 1


def test_without_parsers_the_output_is_all_content() -> None:
    completion = CompletionOutput(0, OUTPUTS[2], [1], finish_reason="stop")
    choice = response_choice(REQUEST, completion, None, single_call=False)
    assert choice.message.content == OUTPUTS[2]
    assert choice.message.tool_calls == [] and choice.finish_reason == "stop"
