"""GrammarSpec: one canonical text per grammar, so equal requests share a compile."""

from __future__ import annotations

import pytest

from ferrum.sampling_params import StructuredOutputsParams
from ferrum.structured_output import GrammarKind, GrammarSpec


def _spec(**kwargs) -> GrammarSpec:
    return GrammarSpec.from_params(StructuredOutputsParams(**kwargs))


def test_json_schema_dict_and_text_give_one_spec():
    as_dict = _spec(json={"type": "object", "properties": {"b": {}, "a": {}}})
    as_text = _spec(json='{ "type" : "object",\n "properties": {"b": {}, "a": {}} }')
    assert as_dict == as_text and hash(as_dict) == hash(as_text)
    assert as_dict.text == '{"type":"object","properties":{"b":{},"a":{}}}'
    # Property order is kept: it orders the generated object's keys.
    assert _spec(json={"type": "object", "properties": {"a": {}, "b": {}}}) != as_dict


def test_each_kind_names_its_field():
    specs = {
        GrammarKind.JSON: _spec(json={"type": "string"}),
        GrammarKind.JSON_OBJECT: _spec(json_object=True),
        GrammarKind.REGEX: _spec(regex="a+"),
        GrammarKind.CHOICE: _spec(choice=["a", "b"]),
        GrammarKind.GRAMMAR: _spec(grammar='root ::= "a"'),
    }
    for kind, spec in specs.items():
        assert spec.kind is kind
        assert spec.field_name == f"structured_outputs.{kind.value}"
    assert specs[GrammarKind.REGEX].text == "a+"
    assert specs[GrammarKind.JSON_OBJECT].text == ""


def test_choice_becomes_an_ebnf_alternation_with_escapes():
    spec = _spec(choice=['say "hi"', "back\\slash", "new\nline", "ünï"])
    assert spec.choice_ebnf() == (
        'root ::= "say \\"hi\\"" | "back\\\\slash" | "new\\nline" | "ünï"'
    )


def test_unserializable_schema_names_the_field():
    with pytest.raises(ValueError, match=r"structured_outputs\.json: not valid JSON data"):
        _spec(json={"type": "number", "maximum": float("nan")})
