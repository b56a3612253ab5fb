"""Constrained chat output through the live server ends valid within max_tokens, whatever the
(weak, temperature 1.0) model does: unbounded JSON schemas, and forced tool calls whose schema has
a `maxLength: 16` string, with `finish_reason` "tool_calls" ("length" where the budget closed
them early), no content and, streamed, no markup in any delta."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.parser_samples import function_tool
from tests.utils.remote_server import RemoteServer

MODEL = DEFAULT_MODEL_NAME
MAX_TOKENS = 200
NUM_CHOICES = 8
USER = [{"role": "user", "content": "Describe a user."}]
# Nothing bounded: strings, numbers, arrays as long as the model likes.
PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "bio": {"type": "string"},
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "age", "bio", "scores"],
}
LOOKUP_PROPERTIES = {
    "key": {"type": "string", "maxLength": 16},
    "count": {"type": "integer"},
    "mode": {"enum": ["exact", "fuzzy"]},
}
LOOKUP = function_tool("lookup", LOOKUP_PROPERTIES, ["key", "count", "mode"])
LOOKUP_PARAMETERS = LOOKUP["function"]["parameters"]


def _chat(server: RemoteServer, **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
        n=NUM_CHOICES,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **kwargs,
    )


def test_unbounded_json_schema_always_ends_valid(server: RemoteServer) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": PROFILE}}
    for choice in _chat(server, response_format=response_format).choices:
        assert choice.finish_reason in ("stop", "length"), choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PROFILE)


@pytest.mark.parametrize("parallel", [True, False])
def test_forced_calls_end_with_valid_arguments(server: RemoteServer, parallel: bool) -> None:
    result = _chat(server, tools=[LOOKUP], tool_choice="required", parallel_tool_calls=parallel)
    for choice in result.choices:
        calls = choice.message.tool_calls
        # "length" where the budget closed the arguments early (valid, but cut short).
        assert choice.finish_reason in ("tool_calls", "length") and calls, choice
        assert choice.message.content is None
        assert parallel or len(calls) == 1
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), LOOKUP_PARAMETERS)


def test_streamed_forced_calls_carry_no_markup(server: RemoteServer) -> None:
    named = {"type": "function", "function": {"name": "lookup"}}
    arguments: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in _chat(server, tools=[LOOKUP], tool_choice=named, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content, choice.delta
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                arguments[choice.index] = arguments.get(choice.index, "") + (
                    call.function.arguments or ""
                )
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert set(finish) == set(range(NUM_CHOICES))
    assert set(finish.values()) <= {"tool_calls", "length"}
    for text in arguments.values():
        jsonschema.validate(json.loads(text), LOOKUP_PARAMETERS)
