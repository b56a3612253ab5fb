"""Request fields to StructuredOutputsParams, and the grammars they become (compiled by xgrammar
and tried on strings)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from ferrum.entrypoints.openai.protocol import CompletionRequest, StructuredOutputsRequest
from ferrum.entrypoints.openai.reasoning import Qwen3ReasoningParser
from ferrum.entrypoints.openai.structured_outputs import (
    after_reasoning,
    requested_constraint,
)
from ferrum.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def constraint(**body: Any) -> StructuredOutputsParams | None:
    request = CompletionRequest.model_validate({"prompt": "x", **body})
    return requested_constraint(request.response_format, request.structured_outputs)


def test_response_format_and_structured_outputs_map_to_one_constraint() -> None:
    assert constraint() is None
    assert constraint(response_format={"type": "text"}) is None
    assert constraint(response_format={"type": "json_object"}).json_object is True
    schema_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    assert constraint(response_format=schema_format).json == SCHEMA
    assert constraint(structured_outputs={"regex": "[ab]+"}).regex == "[ab]+"
    assert constraint(structured_outputs={"choice": ["yes", "no"]}).choice == ["yes", "no"]
    assert constraint(structured_outputs={"json": SCHEMA}).json == SCHEMA
    assert constraint(structured_outputs={"grammar": 'root ::= "a"'}).grammar == 'root ::= "a"'
    with pytest.raises(ValueError, match="not both"):
        constraint(response_format={"type": "json_object"}, structured_outputs={"regex": "a"})


def test_structured_outputs_takes_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsRequest.model_validate({"regex": "a", "grammar": "b"}).to_params()
    with pytest.raises(ValueError):
        StructuredOutputsRequest.model_validate({"guided_regex": "a"})
    schema = StructuredOutputsRequest.model_json_schema()
    assert schema["minProperties"] == schema["maxProperties"] == 1


def grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    assert params.structural_tag is not None
    return xgr.Grammar.from_structural_tag(json.dumps(params.structural_tag))


@pytest.mark.parametrize(
    ("params", "good", "bad"),
    [
        (StructuredOutputsParams(json=SCHEMA), '{"n": 3}', '{"m": 3}'),
        (StructuredOutputsParams(json_object=True), '{"k": [1]}', "[1]"),
        (StructuredOutputsParams(regex="[ab]+"), "abba", "abc"),
        (StructuredOutputsParams(choice=["yes", "no"]), "no", "maybe"),
        (StructuredOutputsParams(grammar='root ::= "x" "y"*'), "xyy", "yx"),
    ],
)
def test_after_reasoning_constrains_only_the_answer(
    params: StructuredOutputsParams, good: str, bad: str
) -> None:
    # The output may open a <think> block (or not); the answer follows it.
    free = grammar(after_reasoning(params, Qwen3ReasoningParser().reasoning_format()))
    assert accepts(free, good)
    assert accepts(free, "<think>any {text} here</think>\n\n" + good)
    assert not accepts(free, "<think>x</think>\n\n" + bad)
    # The prompt left a block open: the output starts inside it.
    opened = Qwen3ReasoningParser(starts_in_reasoning=True).reasoning_format()
    inside = grammar(after_reasoning(params, opened))
    assert accepts(inside, "thinking...</think>\n" + good)
    assert not accepts(inside, good)
