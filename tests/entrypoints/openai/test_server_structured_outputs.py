"""Constrained output through the server with the official client, on the shared server's
random-ish tiny model: whatever it would say, the output parses and matches the schema."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from ferrum.default_model import DEFAULT_MODEL_NAME
from tests.utils.remote_server import RemoteServer

MODEL = DEFAULT_MODEL_NAME
SEEDS = range(4)
USER = [{"role": "user", "content": "Describe a user."}]
# Bounded strings and numbers: every valid output fits in max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_output_always_validates(server: RemoteServer, seed: int) -> None:
    result = server.client().chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=120,
        temperature=1.0,
        seed=seed,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON},
        },
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.parametrize("seed", SEEDS)
def test_completions_structured_outputs_kinds(server: RemoteServer, seed: int) -> None:
    client = server.client()
    kinds: list[tuple[dict[str, Any], Any]] = [
        ({"choice": ["red", "green"]}, lambda text: text in ("red", "green")),
        ({"regex": "[0-9]{3}-[a-z]{2}"}, lambda text: len(text) == 6 and text[3] == "-"),
        ({"json_object": True}, lambda text: isinstance(json.loads(text), dict)),
    ]
    for constraint, holds in kinds:
        result = client.completions.create(
            model=MODEL,
            prompt="Answer:",
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": constraint},
        )
        assert holds(result.choices[0].text), (constraint, result.choices[0].text)


def required_calls(
    server: RemoteServer, seed: int, stream: bool, **kwargs: Any
) -> list[tuple[str, dict]]:
    client = server.client()
    request = {
        "model": MODEL,
        "messages": USER,
        "tools": [WEATHER, TIME],
        "tool_choice": "required",
        # One call: with parallel calls a random model may call again until max_tokens.
        "parallel_tool_calls": False,
        "max_tokens": 120,
        "temperature": 1.0,
        "seed": seed,
        **kwargs,
    }
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len({call.id for call in calls}) == len(calls)
        return [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in client.chat.completions.create(**request, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in names and call.function.name
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (
                    call.function.arguments or ""
                )
    assert finish == "tool_calls"
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)]


@pytest.mark.parametrize("seed", SEEDS)
def test_required_tool_calls_always_parse_and_validate(server: RemoteServer, seed: int) -> None:
    calls = required_calls(server, seed, stream=False)
    assert calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    # The stream's deltas reassemble to the same calls.
    assert required_calls(server, seed, stream=True) == calls


def test_named_tool_choice_calls_that_function_once(server: RemoteServer) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in SEEDS:
        calls = required_calls(server, seed, stream=False, tool_choice=named)
        assert [name for name, _ in calls] == ["get_time"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "json",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "grammar"),
    ],
)
def test_invalid_schema_or_grammar_is_400(server: RemoteServer, body: dict, words: str) -> None:
    with pytest.raises(openai.BadRequestError, match=words):
        server.client().chat.completions.create(
            model=MODEL, messages=USER, max_tokens=4, extra_body=body
        )


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
    ],
)
def test_streamed_invalid_grammar_is_400_before_the_stream(
    server: RemoteServer, endpoint: str, body: dict, param: str
) -> None:
    """The grammar compiles before the request is queued: a 400 naming the field, never a 200
    whose stream then carries an error event."""
    client = server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            client.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=4, stream=True, extra_body=body
            )
        else:
            client.completions.create(
                model=MODEL, prompt=["a", "b"], max_tokens=4, stream=True, extra_body=body
            )
    assert caught.value.body["param"] == param
