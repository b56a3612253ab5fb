"""Bounded whitespace and enforced string lengths, whatever xgrammar does by default."""

from __future__ import annotations

import json

import pytest

from ferrum.sampling_params import StructuredOutputsParams
from ferrum.structured_output import GrammarCompilerService, GrammarSpec
from ferrum.structured_output.json_limits import bound_structural_tag, lengths_as_patterns

SHORT = {
    "type": "object",
    "properties": {"s": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
    "required": ["s", "n"],
}


def _tag(content: dict) -> dict:
    return {
        "type": "structural_tag",
        "format": {"type": "tag", "begin": "<a>", "content": content, "end": "</a>"},
    }


def _accepts(compiler: GrammarCompilerService, params: StructuredOutputsParams, text: str) -> bool:
    matcher = compiler.compile(GrammarSpec.from_params(params)).new_matcher()
    return matcher._matcher.accept_string(text)


def test_short_bounded_strings_become_patterns_everywhere_but_data():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": ["string", "null"], "minLength": 2, "maxLength": 256},
            "b": {"type": "array", "items": {"type": "string", "maxLength": 3}},
            "c": {"type": "string", "maxLength": 3, "pattern": "^x+$"},  # has its own pattern
            "d": {"enum": [{"type": "string", "maxLength": 1}]},  # data, not a schema
            "e": {"type": "string", "maxLength": -1},  # invalid: xgrammar refuses it
            # Free text (no bound, or a long one) keeps its quotes and escapes.
            "f": {"type": "string", "minLength": 1},
            "g": {"type": "string", "maxLength": 257},
        },
    }
    out = lengths_as_patterns(schema, exclude_tags=True)
    assert out["properties"]["a"] == {"type": ["string", "null"], "pattern": "^[^<]{2,256}$"}
    assert out["properties"]["b"]["items"] == {"type": "string", "pattern": "^[^<]{0,3}$"}
    assert out["properties"]["c"] == schema["properties"]["c"]
    assert out["properties"]["d"] == schema["properties"]["d"]
    for name in "efg":
        assert out["properties"][name] == schema["properties"][name]
    short = lengths_as_patterns(SHORT)["properties"]["s"]
    assert short == {"type": "string", "pattern": "^.{0,4}$"}
    assert schema["properties"]["a"]["minLength"] == 2  # the input is not modified


def test_bound_structural_tag_keeps_explicit_bounds():
    tag = _tag({"type": "json_schema", "json_schema": SHORT, "max_whitespace_cnt": 3})
    nested = {"type": "sequence", "elements": [tag["format"], tag["format"]]}
    out = bound_structural_tag({"type": "structural_tag", "format": nested}, 1)
    assert [e["content"]["max_whitespace_cnt"] for e in out["format"]["elements"]] == [3, 3]
    out = bound_structural_tag(_tag({"type": "json_schema", "json_schema": SHORT}), 1)
    assert out["format"]["content"]["max_whitespace_cnt"] == 1


def test_json_is_compact_by_default(compiler):
    params = StructuredOutputsParams(json=SHORT)
    assert _accepts(compiler, params, '{"s": "ab", "n": 1}')
    assert not _accepts(compiler, params, '{"s": "ab",  "n": 1}')
    assert not _accepts(compiler, params, '{\n"s": "ab", "n": 1}')
    assert not _accepts(compiler, StructuredOutputsParams(json_object=True), '{ "a": 1}')


def test_pretty_json_whitespace_is_bounded(tokenizer_info):
    service = GrammarCompilerService(tokenizer_info, any_whitespace=True)
    try:
        params = StructuredOutputsParams(json=SHORT)
        assert _accepts(service, params, '{\n  "s": "ab",\n  "n": 1\n}')
        assert not _accepts(service, params, "{" + " " * 17 + '"s": "ab", "n": 1}')
    finally:
        service.shutdown()


@pytest.mark.parametrize("excludes", [[], ["<tool_call>"]])
def test_max_length_holds_in_structural_tags(compiler, excludes):
    content = {"type": "json_schema", "json_schema": SHORT, "excludes": excludes}
    params = StructuredOutputsParams(structural_tag=_tag(content))
    assert _accepts(compiler, params, '<a>{"s": "abcd", "n": 1}</a>')
    assert not _accepts(compiler, params, '<a>{"s": "abcde", "n": 1}</a>')
    assert not _accepts(compiler, params, '<a>{"s":  "ab", "n": 1}</a>')  # 2 blanks


def test_bounded_strings_hold_no_control_characters(compiler):
    params = StructuredOutputsParams(json=SHORT)
    assert not _accepts(compiler, params, '{"s": "a\tb", "n": 1}')
    text = '{"s": "a<é", "n": 1}'
    assert _accepts(compiler, params, text) and json.loads(text)["s"] == "a<é"
