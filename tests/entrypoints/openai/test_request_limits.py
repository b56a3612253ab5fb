"""Request bodies past a limit (JSON nesting, list sizes) are refused while they are validated:
an error naming the field and the limit, found in milliseconds however big the body; the
published schema states the bounds (token ids: the served model's vocabulary)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from ferrum.entrypoints.openai.chat_protocol import ChatCompletionRequest, TokenizeChatRequest
from ferrum.entrypoints.openai.http_errors import validation_api_error
from ferrum.entrypoints.openai.protocol import CompletionRequest, DetokenizeRequest
from ferrum.entrypoints.openai.request_limits import (
    MAX_MESSAGE_ITEMS,
    MAX_MESSAGES,
    MAX_TOOLS,
    at_most_pattern,
    publish_vocab_size,
)
from ferrum.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_JSON_DEPTH,
    MAX_LIST_CHARS,
    MAX_LIST_ITEMS,
)

MESSAGES = [{"role": "user", "content": "hi"}]
TOO_DEEP = f"nests deeper than {MAX_JSON_DEPTH} levels"


def nested(depth: int) -> Any:
    value: Any = {"type": "integer"}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def refusal(model: type, body: dict[str, Any]) -> tuple[str | None, str]:
    """(param, message) of the 400 the server sends for `body`."""
    with pytest.raises(ValidationError) as error:
        model.model_validate(body)
    body = validation_api_error(RequestValidationError(error.value.errors())).body()["error"]
    return body["param"], body["message"]


def tool(parameters: Any, name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def call(arguments: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        ],
    }


DEEP_CHAT_FIELDS = [
    ({"chat_template_kwargs": {"x": nested(490)}}, "chat_template_kwargs"),
    ({"tools": [tool(nested(300))], "tool_choice": "none"}, "tools.0.function.parameters"),
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": nested(300)},
            }
        },
        "response_format.json_schema.json_schema.schema",
    ),
    ({"structured_outputs": {"json": nested(300)}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": json.dumps(nested(300))}}, "structured_outputs.json"),
    ({"structured_outputs": {"structural_tag": nested(300)}}, "structured_outputs.structural_tag"),
    (
        {"messages": [*MESSAGES, call(json.dumps(nested(900)))]},
        "messages.1.assistant.tool_calls.0.function.arguments",
    ),
    (
        {"messages": [*MESSAGES, call("[" * 200_000 + "]" * 200_000)]},
        "messages.1.assistant.tool_calls.0.function.arguments",
    ),
]


@pytest.mark.parametrize(("fields", "param"), DEEP_CHAT_FIELDS)
def test_deep_json_is_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    assert refusal(ChatCompletionRequest, {"messages": MESSAGES, **fields}) == (
        param,
        f"{param}: Value error, {TOO_DEEP} (the limit of JSON values)",
    )


def test_json_at_the_limit_and_text_that_is_not_json_pass() -> None:
    ChatCompletionRequest.model_validate(
        {
            "messages": [*MESSAGES, call(json.dumps(nested(MAX_JSON_DEPTH))), call("{{{" * 100)],
            "chat_template_kwargs": {"x": nested(MAX_JSON_DEPTH - 1)},
            "tools": [tool(nested(MAX_JSON_DEPTH))],
        }
    )
    param, _ = refusal(TokenizeChatRequest, {"messages": MESSAGES, "tools": [tool(nested(65))]})
    assert param == "tools.0.function.parameters"


HUGE = 1_000_000
LIST_FIELDS = [
    ("stop", ["x"] * HUGE, f"the limit is {MAX_LIST_ITEMS}"),
    ("stop", ["x" * 10_000, "y" * 10_000], f"the limit is {MAX_LIST_CHARS}"),
    ("stop", "x" * (MAX_LIST_CHARS + 1), f"at most {MAX_LIST_CHARS} characters"),
    ("stop_token_ids", [1] * HUGE, f"the limit is {MAX_LIST_ITEMS}"),
    ("bad_words", ["w"] * HUGE, f"the limit is {MAX_LIST_ITEMS}"),
    ("bad_words", ["w" * (MAX_LIST_CHARS + 1)], f"the limit is {MAX_LIST_CHARS}"),
    ("logit_bias", {str(i): 1.0 for i in range(MAX_LIST_ITEMS + 1)}, "the limit is 1024"),
    ("allowed_token_ids", [1] * HUGE, f"the limit is {MAX_ALLOWED_TOKEN_IDS}"),
    ("structured_outputs", {"choice": ["c"] * HUGE}, f"the limit is {MAX_LIST_ITEMS}"),
    ("metadata", {str(i): "v" for i in range(17)}, "the limit is 16"),
    ("prompt", ["p"] * HUGE, "the limit is 128"),
    ("prompt", [[1]] * HUGE, "the limit is 128"),
]


@pytest.mark.parametrize(("field", "value", "limit"), LIST_FIELDS)
def test_list_fields_are_refused_early_naming_field_and_limit(
    field: str, value: Any, limit: str
) -> None:
    # Counted before the items are validated: one error, naming the count.
    param, message = refusal(CompletionRequest, {"prompt": "x", field: value})
    assert param is not None and param.startswith(field) and limit in message


@pytest.mark.parametrize(
    ("messages", "limit"),
    [
        (MESSAGES * (MAX_MESSAGES + 1), f"the limit is {MAX_MESSAGES}"),
        (
            [{"role": "user", "content": [{"type": "text", "text": ""}] * HUGE}],
            f"the limit is {MAX_MESSAGE_ITEMS}",
        ),
        ([{**call("{}"), "tool_calls": call("{}")["tool_calls"] * 2000}] * 3, "tool calls in all"),
    ],
)
def test_conversations_are_counted_before_validation(messages: list, limit: str) -> None:
    for model in (ChatCompletionRequest, TokenizeChatRequest):
        param, message = refusal(model, {"messages": messages})
        assert param == "messages" and limit in message


def test_tools_are_at_most_openais_limit() -> None:
    tools = [tool(None, f"f{i}") for i in range(MAX_TOOLS + 1)]
    param, message = refusal(ChatCompletionRequest, {"messages": MESSAGES, "tools": tools})
    assert param == "tools" and f"the limit is {MAX_TOOLS}" in message


def test_a_huge_list_of_wrong_token_ids_reports_one_error_fast() -> None:
    for model, body in (
        (CompletionRequest, {"prompt": [1] + ["x"] * HUGE}),
        (DetokenizeRequest, {"tokens": [1] + ["x"] * HUGE}),
    ):
        param, message = refusal(model, body)
        assert param in ("prompt.1", "tokens.1") and "more error" not in message


def test_tool_choice_names_a_function_of_tools() -> None:
    named = {"type": "function", "function": {"name": "g"}}
    param, message = refusal(
        ChatCompletionRequest, {"messages": MESSAGES, "tools": [tool(None)], "tool_choice": named}
    )
    assert param == "tool_choice" and "names function 'g', which is not in tools (f)" in message
    param, _ = refusal(ChatCompletionRequest, {"messages": MESSAGES, "tool_choice": named})
    assert param == "tool_choice"
    ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": [tool(None, "g")], "tool_choice": named}
    )


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_stream_options_need_stream(model: type) -> None:
    body = {"prompt": "x"} if model is CompletionRequest else {"messages": MESSAGES}
    options = {"stream_options": {"include_usage": True}}
    for stream in ({}, {"stream": False}):
        param, message = refusal(model, {**body, **options, **stream})
        assert param == "stream_options" and "stream=true" in message
    model.model_validate({**body, **options, "stream": True})
    model.model_validate({**body, "stream_options": None})


def test_completions_accept_the_no_effect_fields() -> None:
    CompletionRequest.model_validate(
        {
            "prompt": "x",
            "user": "u",
            "store": True,
            "metadata": {"k": "v"},
            "service_tier": "auto",
            "prompt_cache_key": "k",
            "safety_identifier": "s",
        }
    )


@pytest.mark.parametrize("m", [*range(0, 130), 999, 1000, 32_000, 151_935, 262_143])
def test_at_most_pattern_matches_exactly_the_integers_up_to_m(m: int) -> None:
    pattern = re.compile(at_most_pattern(m))
    for x in {0, 1, 9, 10, 99, 100, m - 1, m, m + 1, m + 10, 10 * m + 1, 10 ** len(str(m))}:
        if x >= 0:
            assert bool(pattern.fullmatch(str(x))) == (x <= m), (m, x)
    assert not pattern.fullmatch("01") and not pattern.fullmatch("")


def test_the_published_schema_bounds_token_ids_by_the_vocabulary() -> None:
    app = FastAPI()

    @app.post("/v1/completions")
    def completions(body: CompletionRequest) -> None: ...

    @app.post("/detokenize")
    def detokenize(body: DetokenizeRequest) -> None: ...

    publish_vocab_size(app, 1000)
    text = json.dumps(app.openapi())
    assert '"maximum": 999' in text and "x-token-id" not in text
    schemas = app.openapi()["components"]["schemas"]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == 999
    names = schemas["CompletionRequest"]["properties"]["logit_bias"]["propertyNames"]
    assert re.fullmatch(names["pattern"][1:-1], "999") and not re.fullmatch(
        names["pattern"][1:-1], "1000"
    )
