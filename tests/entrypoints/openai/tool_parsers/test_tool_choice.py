"""The forced-call grammar: every output it accepts parses into valid calls of allowed functions.

Outputs are random walks through the compiled grammar over the shipped tokenizer's vocabulary
(any allowed token, then, past a few steps, tokens that spell out closing quotes, brackets and
tags), as a
random-weight model constrained by the grammar would write them.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Qwen3CoderToolParser,
    ToolParser,
)
from ferrum.entrypoints.openai.tool_parsers.tool_choice import (
    forced_function_names,
    tool_call_structural_tag,
)

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                    "metric": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_mode",
            "parameters": {
                "type": "object",
                "properties": {
                    "mode": {"enum": ["fast", "slow"]},
                    "ratio": {"type": "number"},
                    "extra": {"type": "object", "properties": {"k": {"type": "string"}}},
                },
                "required": ["mode"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
NAMED = {"type": "function", "function": {"name": "set_mode"}}
_CLOSERS = ['"', "}", "]", "</parameter>", "</function>", "</tool_call>"]
NUM_WALKS = 25


def test_forced_function_names() -> None:
    assert forced_function_names(TOOLS, None) is None
    assert forced_function_names(TOOLS, "auto") is None
    assert forced_function_names(TOOLS, "none") is None
    assert forced_function_names(TOOLS, "required") == ["get_weather", "set_mode", "get_time"]
    assert forced_function_names(TOOLS, NAMED) == ["set_mode"]
    with pytest.raises(ValueError, match="required.*at least one function"):
        forced_function_names([], "required")
    with pytest.raises(ValueError, match="'nope', which is not in tools"):
        forced_function_names(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="tool_choice must be one of"):
        forced_function_names(TOOLS, "always")
    with pytest.raises(ValueError, match="tool_choice must be one of"):
        forced_function_names(TOOLS, {"type": "function"})
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        forced_function_names([{"type": "function"}], "required")


def test_free_choices_have_no_grammar() -> None:
    for choice in (None, "auto", "none"):
        assert tool_call_structural_tag(HermesToolParser, TOOLS, choice) is None


def test_structural_tag_shape() -> None:
    tag = tool_call_structural_tag(HermesToolParser, TOOLS, NAMED)
    assert tag is not None and tag["type"] == "structural_tag"
    fmt = tag["format"]
    assert fmt["at_least_one"] and fmt["stop_after_first"]
    assert [t["begin"] for t in fmt["tags"]] == ['<tool_call>\n{"name": "set_mode", "arguments": ']
    tag = tool_call_structural_tag(Qwen3CoderToolParser, TOOLS, "required")
    assert tag is not None and not tag["format"]["stop_after_first"]
    assert [t["begin"] for t in tag["format"]["tags"]] == [
        f"<tool_call>\n<function={name}>\n" for name in ("get_weather", "set_mode", "get_time")
    ]
    tag = tool_call_structural_tag(Qwen3CoderToolParser, TOOLS, "required", False)
    assert tag is not None and tag["format"]["stop_after_first"]


@pytest.fixture(scope="module")
def grammar_env() -> tuple[Any, Any, list[str], int]:
    xgr = pytest.importorskip("xgrammar")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    vocab = [tokenizer.decode([i]) for i in range(info.vocab_size)]
    return xgr, xgr.GrammarCompiler(info), vocab, tokenizer.eos_token_id


def _closing_progress(text: str, token: str) -> int:
    """How much of a closing string `text + token` ends with, counting only matches that `token`
    completes or extends (0 if none)."""
    joined = text + token
    return max(
        (j for c in _CLOSERS for j in range(len(token), len(c) + 1) if joined.endswith(c[:j])),
        default=0,
    )


def _walk(xgr: Any, compiled: Any, vocab: list[str], eos: int, rng: random.Random) -> str:
    closers = {i for i, t in enumerate(vocab) if t.strip() and any(t in c for c in _CLOSERS)}
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    ids: list[int] = []
    for step in range(1000):
        if matcher.is_terminated():
            return "".join(vocab[i] for i in ids if i != eos)
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: len(vocab)]
        allowed = np.flatnonzero(bits).tolist()
        if step > 15:
            text = "".join(vocab[i] for i in ids[-4:])
            closing = [i for i in allowed if i in closers]
            progress = {i: _closing_progress(text, vocab[i]) for i in closing}
            best = max(progress.values(), default=0)
            allowed = [i for i in closing if progress[i] == best] if best else allowed
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        ids.append(token)
    raise AssertionError(
        f"the walk did not end within 1000 tokens: {''.join(vocab[i] for i in ids)[-300:]!r}"
    )


@pytest.mark.parametrize("parser", [HermesToolParser, Qwen3CoderToolParser])
@pytest.mark.parametrize("choice", ["required", "required-single", "named"])
def test_every_output_of_the_grammar_parses_into_valid_calls(
    grammar_env: tuple[Any, Any, list[str], int], parser: type[ToolParser], choice: str
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    xgr, compiler, vocab, eos = grammar_env
    tool_choice = NAMED if choice == "named" else "required"
    tag = tool_call_structural_tag(parser, TOOLS, tool_choice, choice == "required")
    compiled = compiler.compile_structural_tag(json.dumps(tag))
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}
    rng = random.Random(f"{parser.name}/{choice}")
    num_calls = []
    for _ in range(NUM_WALKS):
        text = _walk(xgr, compiled, vocab, eos, rng)
        content, calls = parser(TOOLS).extract_tool_calls(text)
        assert content == "", text
        assert calls, text
        num_calls.append(len(calls))
        for call in calls:
            if choice == "named":
                assert call.name == "set_mode"
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    if choice == "required":
        assert max(num_calls) > 1  # parallel calls happen
    else:
        assert num_calls == [1] * NUM_WALKS
