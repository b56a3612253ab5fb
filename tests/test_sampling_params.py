"""StructuredOutputsParams validation and its place in SamplingParams."""

from __future__ import annotations

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
        ({}, "exactly one of json, regex, choice, grammar, json_object must be set, got none"),
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
