"""Constrained outputs end valid with a deliberately bad model: a tiny random-weight Qwen3 with the
shipped tokenizer, temperature 1.0, max_tokens 200, many seeds in one batch. Every JSON output
parses and validates; every forced tool call parses, its arguments validate (a `maxLength: 16`
string included) and the output ends after the calls; under "auto" no markup is left as text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.entrypoints.openai.tool_parsers import HermesToolParser, Qwen3CoderToolParser
from ferrum.entrypoints.openai.tool_parsers.tool_choice import (
    auto_tool_call_structural_tag,
    tool_call_structural_tag,
)
from ferrum.sampling_params import StructuredOutputsParams
from tests.utils.parser_samples import function_tool

MAX_TOKENS = 200
SEEDS = range(16)
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer"},
                        "tag": {"type": "string", "maxLength": 16},
                        "price": {"type": "number"},
                    },
                    "required": ["id", "tag", "price"],
                },
            },
            "ok": {"type": "boolean"},
            "note": {"type": "string"},
        },
        "required": ["items", "ok", "note"],
    },
    "object": {"type": "object"},  # json_object: any object
}
WEATHER = {
    "city": {"type": "string", "maxLength": 16},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
}
TOOLS = [
    function_tool("get_weather", WEATHER, ["city", "unit", "days"]),
    function_tool("search", {"query": {"type": "string"}, "limit": {"type": "integer"}}, ["query"]),
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def bad_llm(tiny_checkpoint, tmp_path_factory) -> LLM:
    """Random weights (std 0.15: peaked, arbitrary preferences) behind the shipped tokenizer."""
    path = Path(tmp_path_factory.mktemp("bad_model"))
    source = tiny_checkpoint("qwen3", vocab_size=8192, max_position_embeddings=1024)
    shutil.copytree(source, path, dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEFAULT_MODEL_DIR) / name, path / name)
    return LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=1024, max_model_len=1024)


def _params(constraint: StructuredOutputsParams, seed: int, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, max_tokens=MAX_TOKENS, seed=seed, structured_outputs=constraint, **extra
    )


def test_every_json_output_is_valid(bad_llm):
    requests = []
    for name, schema in SCHEMAS.items():
        if name == "object":
            constraint = StructuredOutputsParams(json_object=True)
        else:
            constraint = StructuredOutputsParams(json=schema)
        requests += [(name, _params(constraint, seed)) for seed in SEEDS]
    outputs = bad_llm.generate(
        ["Reply in JSON:"] * len(requests), [p for _, p in requests], use_tqdm=False
    )
    for (name, _), output in zip(requests, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason in ("stop", "length"), completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMAS[name])


@pytest.mark.parametrize("parser", [HermesToolParser, Qwen3CoderToolParser])
def test_forced_tool_calls_are_valid_and_end(bad_llm, parser):
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [("required", True), ("required", False), (named, False)]
    requests = []
    for tool_choice, parallel in cases:
        tag = tool_call_structural_tag(parser, TOOLS, tool_choice, parallel)
        constraint = StructuredOutputsParams(structural_tag=tag)
        requests += [(parallel, _params(constraint, seed)) for seed in SEEDS[:8]]
    outputs = bad_llm.generate(
        ["Call a tool:"] * len(requests), [p for _, p in requests], use_tqdm=False
    )
    for (parallel, _), output in zip(requests, outputs):
        completion = output.outputs[0]
        content, calls = parser(TOOLS).extract_tool_calls(completion.text)
        assert completion.finish_reason in ("stop", "length"), completion.text
        assert content == "" and calls, completion.text
        assert parallel or len(calls) == 1, completion.text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])


@pytest.mark.parametrize("parser", [HermesToolParser, Qwen3CoderToolParser])
def test_auto_output_holds_no_markup(bad_llm, parser):
    """Text, and any call the model opens is complete and valid (this model seldom opens one:
    tests/structured_output/test_closing.py forces the start tag)."""
    tag = auto_tool_call_structural_tag(parser, TOOLS)
    params = [_params(StructuredOutputsParams(structural_tag=tag), seed) for seed in SEEDS]
    outputs = bad_llm.generate(["Answer or call a tool:"] * len(params), params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        content, calls = parser(TOOLS).extract_tool_calls(completion.text)
        assert parser.START_TAG not in content, completion.text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])
