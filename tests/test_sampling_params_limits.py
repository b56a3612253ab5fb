"""SamplingParams' bounds on list fields and JSON nesting: a FieldError naming the field and the
limit (the offline LLM and the server alike), never a RecursionError."""

from __future__ import annotations

import json

import pytest

from ferrum.errors import FieldError
from ferrum.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_GRAMMAR_JSON_DEPTH,
    MAX_JSON_DEPTH,
    MAX_LIST_CHARS,
    MAX_LIST_ITEMS,
    SamplingParams,
    StructuredOutputsParams,
    json_depth_exceeds,
)


def nested(depth: int) -> dict:
    """A JSON schema whose dicts nest `depth` levels."""
    value: dict = {"type": "integer"}
    for _ in range(depth - 1):
        value = {"anyOf": value} if len(value) == 1 else {"not": value}
    return value


def test_json_depth_is_measured_without_recursion() -> None:
    assert not json_depth_exceeds(nested(MAX_JSON_DEPTH))
    assert json_depth_exceeds(nested(MAX_JSON_DEPTH + 1))
    assert json_depth_exceeds(nested(100_000))
    deep_list: list = []
    for _ in range(100_000):
        deep_list = [deep_list]
    assert json_depth_exceeds({"a": deep_list})
    assert not json_depth_exceeds("a string") and not json_depth_exceeds([1, [2], {"a": [3]}], 3)
    assert json_depth_exceeds([1, [2], {"a": [3]}], 2)


@pytest.mark.parametrize("kind", ["json", "structural_tag"])
@pytest.mark.parametrize("as_text", [False, True])
def test_deep_schemas_name_the_field_and_the_limit(kind: str, as_text: bool) -> None:
    value = nested(300)
    with pytest.raises(FieldError, match=f"nests deeper than {MAX_GRAMMAR_JSON_DEPTH}") as error:
        StructuredOutputsParams(**{kind: json.dumps(value) if as_text else value})
    assert error.value.field == "structured_outputs"
    # A schema at the limit passes, and SamplingParams copies it (clone deep-copies).
    schema = nested(MAX_GRAMMAR_JSON_DEPTH)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    assert params.clone().structured_outputs.json == schema


def test_json_text_too_deep_for_the_parser_is_a_field_error() -> None:
    with pytest.raises(FieldError, match="structured_outputs.json"):
        StructuredOutputsParams(json="[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"stop": ["x"] * (MAX_LIST_ITEMS + 1)}, "stop", MAX_LIST_ITEMS),
        ({"stop": ["x" * (MAX_LIST_CHARS + 1)]}, "stop", MAX_LIST_CHARS),
        ({"stop_token_ids": [1] * (MAX_LIST_ITEMS + 1)}, "stop_token_ids", MAX_LIST_ITEMS),
        ({"bad_words": ["w"] * (MAX_LIST_ITEMS + 1)}, "bad_words", MAX_LIST_ITEMS),
        ({"bad_words": ["w" * (MAX_LIST_CHARS + 1)]}, "bad_words", MAX_LIST_CHARS),
        ({"logit_bias": dict.fromkeys(range(MAX_LIST_ITEMS + 1), 1.0)}, "logit_bias", 1024),
        (
            {"allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))},
            "allowed_token_ids",
            MAX_ALLOWED_TOKEN_IDS,
        ),
    ],
)
def test_list_fields_name_the_field_and_the_limit(kwargs: dict, field: str, limit: int) -> None:
    with pytest.raises(FieldError, match=f"the limit is {limit}") as error:
        SamplingParams(**kwargs)
    assert error.value.field == field
    assert str(error.value).startswith(field)


def test_lists_at_the_limits_are_accepted() -> None:
    SamplingParams(
        stop=["s" * 16] * MAX_LIST_ITEMS,
        stop_token_ids=list(range(MAX_LIST_ITEMS)),
        bad_words=["w" * 16] * MAX_LIST_ITEMS,
        logit_bias=dict.fromkeys(range(MAX_LIST_ITEMS), 1.0),
        allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS)),
    )
    StructuredOutputsParams(choice=["c" * 16] * MAX_LIST_ITEMS)


def test_choice_limits_name_the_field() -> None:
    with pytest.raises(FieldError, match="structured_outputs.choice holds 1025 items"):
        StructuredOutputsParams(choice=["c"] * (MAX_LIST_ITEMS + 1))
    with pytest.raises(FieldError, match=f"the limit is {MAX_LIST_CHARS}"):
        StructuredOutputsParams(choice=["c" * (MAX_LIST_CHARS + 1)])
