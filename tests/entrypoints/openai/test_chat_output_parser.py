"""Streaming parse == whole-text parse, for every split of recorded outputs into token deltas.

The deltas come from the shipped tokenizer and ferrum's incremental detokenizer, grouped into
random steps of 1-4 tokens as an engine would emit them; also per character and at random
character boundaries. Every split must reassemble to exactly the whole-text result: the same
reasoning, the same content (no character lost or repeated), the same calls.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable

import pytest

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.detokenizer import IncrementalDetokenizer
from ferrum.engine.tokenizer import Tokenizer
from ferrum.entrypoints.openai.chat_output_parser import ChatDelta, ChatOutputParser, ParsedChat
from ferrum.entrypoints.openai.reasoning import Qwen3ReasoningParser
from ferrum.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Qwen3CoderToolParser,
    ToolCall,
    ToolParser,
)
from ferrum.sampling_params import SamplingParams
from tests.utils.parser_samples import HERMES_SAMPLES, QWEN3_CODER_SAMPLES, TOOLS, Sample

NUM_TOKEN_SPLITS = 300
NUM_CHAR_SPLITS = 100
CASES = [(HermesToolParser, s) for s in HERMES_SAMPLES] + [
    (Qwen3CoderToolParser, s) for s in QWEN3_CODER_SAMPLES
]
CASE_IDS = [f"{parser.name}-{sample.name}" for parser, sample in CASES]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def _prompt_ids(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)


def _token_deltas(tokenizer: Tokenizer, text: str) -> list[str]:
    """The text each generated token adds, as the engine's detokenizer streams it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, _prompt_ids(tokenizer), SamplingParams())
    deltas = []
    for token_id in ids:
        detokenizer.update([token_id], stop_terminated=False)
        deltas.append(detokenizer.get_next_output_text(finished=False, delta=True))
    deltas[-1] += detokenizer.get_next_output_text(finished=True, delta=True)
    assert "".join(deltas) == text
    return deltas


def _group(deltas: list[str], rng: random.Random) -> list[str]:
    pieces, at = [], 0
    while at < len(deltas):
        step = rng.randint(1, 4)
        pieces.append("".join(deltas[at : at + step]))
        at += step
    return pieces


def _char_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _parser(tool_parser: type[ToolParser], sample: Sample) -> ChatOutputParser:
    reasoning = Qwen3ReasoningParser(starts_in_reasoning=sample.starts_in_reasoning)
    return ChatOutputParser(reasoning, tool_parser(TOOLS))


def _reassemble(deltas: Iterable[ChatDelta]) -> ParsedChat:
    """Joins stream deltas as an OpenAI client does, checking the tool_calls delta protocol."""
    reasoning, content, calls = "", "", []
    for delta in deltas:
        reasoning += delta.reasoning_content
        content += delta.content
        for call in delta.tool_calls:
            if call.id is not None:
                # A new call: the next index, named, before any of its arguments.
                assert call.index == len(calls) and call.name and call.arguments == ""
                calls.append(ToolCall(call.id, call.name, ""))
            else:
                assert call.index == len(calls) - 1 and call.name is None
                last = calls[-1]
                calls[-1] = ToolCall(last.id, last.name, last.arguments + call.arguments)
    return ParsedChat(reasoning, content, calls)


def _stream(parser: ChatOutputParser, pieces: list[str]) -> ParsedChat:
    return _reassemble([*(parser.parse_delta(p) for p in pieces), parser.finish()])


def _arguments(text: str, expected: object) -> object:
    """A call's arguments as the sample records them: parsed, or as text where it expects text."""
    return text if isinstance(expected, str) else json.loads(text)


def _assert_same(got: ParsedChat, expected: ParsedChat) -> None:
    assert got.reasoning_content == expected.reasoning_content
    assert got.content == expected.content
    assert [(c.name, c.arguments) for c in got.tool_calls] == [
        (c.name, c.arguments) for c in expected.tool_calls
    ]


@pytest.mark.parametrize(("tool_parser", "sample"), CASES, ids=CASE_IDS)
def test_whole_text_parse_matches_the_recorded_expectation(
    tool_parser: type[ToolParser], sample: Sample
) -> None:
    parsed = _parser(tool_parser, sample).parse(sample.text)
    assert parsed.reasoning_content == sample.reasoning
    assert parsed.content == sample.content
    assert [
        (c.name, _arguments(c.arguments, expected))
        for c, (_, expected) in zip(parsed.tool_calls, sample.calls, strict=True)
    ] == sample.calls
    assert all(c.id.startswith("call_") for c in parsed.tool_calls)
    assert len({c.id for c in parsed.tool_calls}) == len(parsed.tool_calls)


@pytest.mark.parametrize(("tool_parser", "sample"), CASES, ids=CASE_IDS)
def test_every_token_split_streams_the_whole_text_parse(
    tokenizer: Tokenizer, tool_parser: type[ToolParser], sample: Sample
) -> None:
    expected = _parser(tool_parser, sample).parse(sample.text)
    deltas = _token_deltas(tokenizer, sample.text)
    rng = random.Random(f"{tool_parser.name}/{sample.name}")
    for _ in range(NUM_TOKEN_SPLITS):
        _assert_same(_stream(_parser(tool_parser, sample), _group(deltas, rng)), expected)
    _assert_same(_stream(_parser(tool_parser, sample), deltas), expected)


@pytest.mark.parametrize(("tool_parser", "sample"), CASES, ids=CASE_IDS)
def test_every_character_split_streams_the_whole_text_parse(
    tool_parser: type[ToolParser], sample: Sample
) -> None:
    expected = _parser(tool_parser, sample).parse(sample.text)
    _assert_same(_stream(_parser(tool_parser, sample), list(sample.text)), expected)
    _assert_same(_stream(_parser(tool_parser, sample), [sample.text]), expected)
    rng = random.Random(f"chars/{tool_parser.name}/{sample.name}")
    for _ in range(NUM_CHAR_SPLITS):
        _assert_same(_stream(_parser(tool_parser, sample), _char_split(sample.text, rng)), expected)


def test_grouped_detokenizer_steps_equal_joined_token_deltas(tokenizer: Tokenizer) -> None:
    """The fuzz joins per-token deltas; the detokenizer fed 1-4 tokens a step emits the same."""
    rng = random.Random(0)
    for sample in (HERMES_SAMPLES[3], QWEN3_CODER_SAMPLES[1], HERMES_SAMPLES[0]):
        ids = tokenizer.encode(sample.text, add_special_tokens=False)
        per_token = _token_deltas(tokenizer, sample.text)
        for _ in range(5):
            detokenizer = IncrementalDetokenizer(
                tokenizer, _prompt_ids(tokenizer), SamplingParams()
            )
            at = 0
            while at < len(ids):
                step = rng.randint(1, 4)
                detokenizer.update(ids[at : at + step], stop_terminated=False)
                finished = at + step >= len(ids)
                got = detokenizer.get_next_output_text(finished=finished, delta=True)
                assert got == "".join(per_token[at : at + step])
                at += step


def test_without_parsers_the_text_passes_through() -> None:
    parser = ChatOutputParser(None, None)
    text = "<think>x</think><tool_call>{}</tool_call>"
    assert parser.parse(text) == ParsedChat("", text, [])
    assert _stream(parser, list(text)) == ParsedChat("", text, [])
