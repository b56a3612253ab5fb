"""StructuredOutputsParams validation and its place in SamplingParams; the token-level fields
(logit_bias, allowed_token_ids, bad_words, prompt_logprobs)."""

from __future__ import annotations

import dataclasses

import pytest

from ferrum.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [
        ({"json": {"type": "object"}}, "json"),
        ({"json": '{"type": "object"}'}, "json"),
        ({"regex": "[0-9]+"}, "regex"),
        ({"choice": ("a", "b")}, "choice"),
        ({"grammar": 'root ::= "a"'}, "grammar"),
        ({"json_object": True}, "json_object"),
        ({"regex": "a", "json_object": False}, "regex"),
        ({"structural_tag": {"type": "structural_tag", "format": {}}}, "structural_tag"),
        ({"structural_tag": '{"type": "structural_tag"}'}, "structural_tag"),
    ],
)
def test_exactly_one_kind_is_accepted(kwargs, kind):
    params = StructuredOutputsParams(**kwargs)
    assert params.kind == kind
    if kind == "choice":
        assert params.choice == ["a", "b"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {},
            "exactly one of json, regex, choice, grammar, json_object, structural_tag must be "
            "set, got none",
        ),
        ({"json_object": False}, "got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        (
            {"json": "{not json"},
            r"structured_outputs\.json must be a JSON schema; the string is not JSON",
        ),
        ({"json": "[1]"}, r"structured_outputs\.json must be a JSON schema object"),
        ({"json": 3}, r"structured_outputs\.json must be a JSON schema object"),
        ({"regex": ""}, r"structured_outputs\.regex must be a non-empty string"),
        ({"grammar": 5}, r"structured_outputs\.grammar must be a non-empty string"),
        ({"choice": "ab"}, r"structured_outputs\.choice must be a list of strings"),
        ({"choice": []}, r"structured_outputs\.choice must hold at least one string"),
        ({"choice": ["a", ""]}, r"structured_outputs\.choice must contain only non-empty strings"),
        ({"choice": ["a", 1]}, r"structured_outputs\.choice must contain only non-empty strings"),
        ({"json_object": "yes"}, r"structured_outputs\.json_object must be a bool"),
        ({"structural_tag": "[]"}, r"structured_outputs\.structural_tag must be a structural tag"),
        ({"structural_tag": "{"}, r"structured_outputs\.structural_tag must be a structural tag;"),
    ],
)
def test_invalid_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_checks_the_type():
    with pytest.raises(
        ValueError, match=r"SamplingParams\.structured_outputs must be a StructuredOutputsParams"
    ):
        SamplingParams(structured_outputs={"json": {}})
    assert SamplingParams().structured_outputs is None


def test_clone_copies_the_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    copy = params.clone()
    assert copy.structured_outputs == params.structured_outputs
    assert copy.structured_outputs is not params.structured_outputs
    copy.structured_outputs.json["properties"]["b"] = {}
    assert "b" not in params.structured_outputs.json["properties"]


def test_token_level_fields_are_kept_and_copied():
    params = SamplingParams(
        logit_bias={3: 5.0, 7: -100},
        allowed_token_ids=(1, 2, 3),
        bad_words=("foo bar",),
        prompt_logprobs=0,
    )
    assert params.allowed_token_ids == [1, 2, 3] and params.bad_words == ["foo bar"]
    copy = params.clone()
    copy.logit_bias[4] = 1.0
    copy.allowed_token_ids.append(9)
    copy.bad_words.append("baz")
    assert params.logit_bias == {3: 5.0, 7: -100}
    assert params.allowed_token_ids == [1, 2, 3] and params.bad_words == ["foo bar"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": [1.0]}, r"logit_bias must be a dict"),
        ({"logit_bias": {"3": 1.0}}, r"logit_bias keys must be non-negative integer token ids"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias keys must be non-negative"),
        ({"logit_bias": {3: 100.5}}, r"logit_bias values must be numbers in \[-100, 100\]"),
        ({"logit_bias": {3: True}}, r"logit_bias values must be numbers"),
        ({"allowed_token_ids": []}, r"allowed_token_ids must be a non-empty list"),
        ({"allowed_token_ids": [1, -2]}, r"allowed_token_ids must contain only non-negative"),
        ({"bad_words": "word"}, r"bad_words must be a list of strings"),
        ({"bad_words": ["ok", " "]}, r"bad_words must contain only non-blank strings"),
        ({"prompt_logprobs": 21}, r"prompt_logprobs must be an integer in \[0, 20\]"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs must be an integer in \[0, 20\]"),
    ],
)
def test_token_level_fields_name_the_field_and_the_limit(kwargs, message):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{message}"):
        SamplingParams(**kwargs)


def test_resolve_adds_what_the_engine_decides_and_keeps_the_rest():
    params = SamplingParams(n=2, seed=3, max_tokens=None, stop_token_ids=[4], logit_bias={1: 2.0})
    resolved = params.resolve(max_tokens=9, seed=4, stop_token_ids=[2], bad_words_token_ids=[[5]])
    assert (resolved.max_tokens, resolved.seed) == (9, 4)
    assert resolved.all_stop_token_ids == {2, 4} and resolved.bad_words_token_ids == ((5,),)
    assert resolved.logit_bias == {1: 2.0} and resolved.logit_bias is not params.logit_bias
    assert params.max_tokens is None and params.seed == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.max_tokens = 1  # type: ignore[misc]
