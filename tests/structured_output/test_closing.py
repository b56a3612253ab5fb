"""A matcher with a token budget ends its grammar in time: a "model" of random logits (no wish to
ever close a string) still gives complete, valid output within max_tokens, every seed."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from grammar_fixtures import MODEL_VOCAB_SIZE

from ferrum.entrypoints.openai.tool_parsers import HermesToolParser, Qwen3CoderToolParser
from ferrum.entrypoints.openai.tool_parsers.tool_choice import (
    auto_tool_call_structural_tag,
    tool_call_structural_tag,
)
from ferrum.model_executor.token_bitmask import allocate_token_bitmask, apply_token_bitmask_
from ferrum.sampling_params import StructuredOutputsParams
from ferrum.structured_output import GrammarCompilerService, GrammarSpec
from ferrum.structured_output.closing import tag_exits
from tests.utils.parser_samples import function_tool

SEEDS = range(24)
MAX_TOKENS = 120
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "mode": {"enum": ["fast", "slow"]},
            "address": {
                "type": "object",
                "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"],
            },
        },
        "required": ["name", "age", "tags", "mode", "address"],
    },
    "nested": {
        "type": "array",
        "items": {"type": "array", "items": {"type": "object"}},
    },
}
WEATHER = {
    "city": {"type": "string", "maxLength": 16},
    "days": {"type": "integer"},
    "note": {"type": "string"},
}
TOOLS = [function_tool("get_weather", WEATHER, ["city", "days", "note"])]


def _sample(
    compiler: GrammarCompilerService,
    spec: GrammarSpec,
    seed: int,
    max_tokens: int,
    prefix: tuple[int, ...] = (),
) -> tuple[list[int], str]:
    """Random logits, masked, sampled after `prefix` until the request would end; (token ids,
    prefix included, and the finish reason)."""
    matcher = compiler.compile(spec).new_matcher(max_tokens)
    assert matcher.accept_tokens(prefix)
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_token_bitmask(1, MODEL_VOCAB_SIZE)
    token_ids = list(prefix)
    while len(token_ids) < max_tokens:
        matcher.fill_bitmask(bitmask, 0)
        logits = 3.0 * torch.randn(1, MODEL_VOCAB_SIZE, generator=generator)
        apply_token_bitmask_(logits, bitmask)
        token_id = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=generator))
        assert matcher.accept_tokens([token_id])
        token_ids.append(token_id)
        if matcher.is_terminated():
            return token_ids[:-1], "stop"
    return token_ids, "length"


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_ends_valid_within_budget(compiler, tokenizer, name):
    spec = GrammarSpec.from_params(StructuredOutputsParams(json=SCHEMAS[name]))
    for seed in SEEDS:
        token_ids, finish = _sample(compiler, spec, seed, MAX_TOKENS)
        text = tokenizer.decode(token_ids, skip_special_tokens=False)
        assert finish == "stop", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


@pytest.mark.parametrize("parser", [HermesToolParser, Qwen3CoderToolParser])
@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_tool_calls_end_valid_within_budget(compiler, tokenizer, parser, tool_choice):
    if tool_choice == "auto":
        tag = auto_tool_call_structural_tag(parser, TOOLS)
    else:
        tag = tool_call_structural_tag(parser, TOOLS, tool_choice)
    spec = GrammarSpec.from_params(StructuredOutputsParams(structural_tag=tag))
    schema = TOOLS[0]["function"]["parameters"]
    # Under "auto" the model has opened a call: it must end, valid.
    prefix = tokenizer.encode(parser.START_TAG, add_special_tokens=False)
    prefix = tuple(prefix) if tool_choice == "auto" else ()
    for seed in SEEDS[:12]:
        token_ids, finish = _sample(compiler, spec, seed, MAX_TOKENS, prefix)
        text = tokenizer.decode(token_ids, skip_special_tokens=False)
        content, calls = parser(TOOLS).extract_tool_calls(text)
        assert finish == "stop" and calls, (seed, text)
        if tool_choice == "required":
            assert content == "", text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), schema)


def test_room_to_spare_leaves_the_mask_alone(compiler, tokenizer):
    """A short budget that fits the choices: the model's choice stands."""
    spec = GrammarSpec.from_params(StructuredOutputsParams(choice=["yes", "no"]))
    texts = {
        tokenizer.decode(_sample(compiler, spec, seed, 3)[0], skip_special_tokens=False)
        for seed in SEEDS
    }
    assert texts == {"yes", "no"}


def test_tag_exits():
    tag = tool_call_structural_tag(Qwen3CoderToolParser, TOOLS, "required")
    closing_tags, ends = tag_exits(tag)
    assert "</parameter>" in closing_tags and "</function>" in closing_tags
    assert ends == ["</function>\n</tool_call>"]
