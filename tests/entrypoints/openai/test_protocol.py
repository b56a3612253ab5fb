"""Request models: strict, closed to unknown fields, and in agreement with their JSON schema."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, ValidationError

from ferrum.entrypoints.openai.chat_protocol import ChatCompletionRequest, TokenizeChatRequest
from ferrum.entrypoints.openai.protocol import (
    NO_EFFECT_FIELDS,
    CompletionRequest,
    TokenizeCompletionRequest,
)

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

JSON, TEXT, SO = {"type": "json_object"}, {"type": "text"}, {"json_object": True}
CASES: list[tuple[type[BaseModel], dict[str, Any], bool]] = [
    # Booleans are not integers, numbers are not strings.
    (CompletionRequest, {"prompt": "x", "max_tokens": True}, False),
    (CompletionRequest, {"prompt": "x", "top_k": False}, False),
    (CompletionRequest, {"prompt": [[False]]}, False),
    (CompletionRequest, {"prompt": [1, True]}, False),
    (CompletionRequest, {"prompt": "x", "n": 1.5}, False),
    (CompletionRequest, {"prompt": "x", "n": 2.0}, True),  # JSON Schema: 2.0 is an integer
    (CompletionRequest, {"prompt": "x", "temperature": 1}, True),
    (CompletionRequest, {"prompt": "x", "stream": 1}, False),
    (CompletionRequest, {"prompt": 5}, False),
    # An empty prompt has no tokens to continue: invalid in both.
    (CompletionRequest, {"prompt": ""}, False),
    (CompletionRequest, {"prompt": [""]}, False),
    (CompletionRequest, {"prompt": "x", "stop": ""}, False),
    (CompletionRequest, {"prompt": "x", "echo": True}, True),
    (CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 1}, True),
    (CompletionRequest, {"prompt": "x", "stream": True, "prompt_logprobs": 1}, False),
    (CompletionRequest, {"prompt": "x", "stream": False, "prompt_logprobs": 1}, True),
    (ChatCompletionRequest, {"messages": USER, "stream": True, "prompt_logprobs": 0}, False),
    (CompletionRequest, {"prompt": "x", "response_format": JSON, "structured_outputs": SO}, False),
    (CompletionRequest, {"prompt": "x", "response_format": TEXT, "structured_outputs": SO}, True),
    (
        ChatCompletionRequest,
        {"messages": USER, "response_format": JSON, "structured_outputs": SO},
        False,
    ),
    (CompletionRequest, {"prompt": "x", "echo": False, "logprobs": 1}, True),
    (CompletionRequest, {"prompt": "x", "suffix": ""}, True),
    (CompletionRequest, {"prompt": "x", "suffix": "end"}, False),
    (CompletionRequest, {"prompt": "x", "user": "u1"}, True),
    # Unknown fields, including other servers' extensions, are errors.
    (CompletionRequest, {"prompt": "x", "guided_json": {}}, False),
    (ChatCompletionRequest, {"messages": USER, "temperature_": 1.0}, False),
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": 2}, False),
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": 2, "logprobs": True}, True),
    (ChatCompletionRequest, {"messages": USER, "top_logprobs": None}, True),
    (ChatCompletionRequest, {"messages": USER, "continue_final_message": True}, False),
    (
        ChatCompletionRequest,
        {"messages": USER, "continue_final_message": True, "add_generation_prompt": False},
        True,
    ),
    (ChatCompletionRequest, {"messages": USER, "tools": [TOOL], "tool_choice": "required"}, True),
    (ChatCompletionRequest, {"messages": USER, "tool_choice": "sometimes"}, False),
    (ChatCompletionRequest, {"messages": [{"role": "user"}]}, False),
    (ChatCompletionRequest, {"messages": [{"role": "tool", "content": "x"}]}, False),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]},
        True,
    ),
    (
        ChatCompletionRequest,
        {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
        False,
    ),
    (
        ChatCompletionRequest,
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
        False,
    ),
    (ChatCompletionRequest, {"messages": USER, "store": True, "metadata": {"k": "v"}}, True),
    (ChatCompletionRequest, {"messages": USER, "service_tier": "auto", "user": "u"}, True),
    # Constrained output and sampling extensions.
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"regex": "a+"}}, True),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {}}, False),
    (
        CompletionRequest,
        {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
        False,
    ),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"regex": None}}, False),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"json_object": False}}, False),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"choice": []}}, False),
    (CompletionRequest, {"prompt": "x", "structured_outputs": {"guided_json": {}}}, False),
    (ChatCompletionRequest, {"messages": USER, "response_format": {"type": "json_object"}}, True),
    (
        ChatCompletionRequest,
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
            },
        },
        True,
    ),
    (ChatCompletionRequest, {"messages": USER, "response_format": {"type": "json_schema"}}, False),
    (ChatCompletionRequest, {"messages": USER, "response_format": {"type": "yaml"}}, False),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"42": -100}}, True),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"42": 100.5}}, False),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"a": 1}}, False),
    (CompletionRequest, {"prompt": "x", "allowed_token_ids": []}, False),
    (CompletionRequest, {"prompt": "x", "allowed_token_ids": [3, 4]}, True),
    (CompletionRequest, {"prompt": "x", "bad_words": [" "]}, False),
    (CompletionRequest, {"prompt": "x", "bad_words": ["darn"]}, True),
    (TokenizeChatRequest, {"messages": []}, False),
    (TokenizeChatRequest, {"messages": USER}, True),
    (TokenizeCompletionRequest, {"prompt": ""}, True),
    (TokenizeCompletionRequest, {"prompt": "x", "messages": USER}, False),
]


def accepts(model: type[BaseModel], body: dict[str, Any]) -> bool:
    try:
        model.model_validate(body)
    except ValidationError:
        return False
    return True


def schema_accepts(model: type[BaseModel], body: dict[str, Any]) -> bool:
    validator = jsonschema.Draft202012Validator(model.model_json_schema())
    return validator.is_valid(body)


@pytest.mark.parametrize(("model", "body", "valid"), CASES)
def test_validation_and_schema_agree(
    model: type[BaseModel], body: dict[str, Any], valid: bool
) -> None:
    assert accepts(model, body) is valid
    assert schema_accepts(model, body) is valid


def test_unknown_field_error_names_it() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a+"})
    assert info.value.errors()[0]["loc"] == ("guided_regex",)


def test_cross_field_errors_name_their_field() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": USER, "top_logprobs": 1})
    assert info.value.errors()[0]["loc"] == ("top_logprobs",)
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "n": 2, "best_of": 3})
    assert info.value.errors()[0]["loc"] == ("best_of",)
    assert "best_of (3) must equal n (2)" in str(info.value)
    assert accepts(CompletionRequest, {"prompt": "x", "n": 2, "best_of": 2})


def test_image_content_parts_get_one_clear_error() -> None:
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": messages})
    errors = info.value.errors()
    assert len(errors) == 1 and errors[0]["loc"] == ("messages", 0, "user", "content")
    assert "content part type 'image_url' is not supported" in errors[0]["msg"]


def test_no_effect_fields_are_accepted_by_chat() -> None:
    fields = ChatCompletionRequest.model_fields
    assert set(NO_EFFECT_FIELDS) <= set(fields)
    assert "user" in CompletionRequest.model_fields
