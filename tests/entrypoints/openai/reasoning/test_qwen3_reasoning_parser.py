from __future__ import annotations

import random

import pytest

from ferrum.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    Qwen3ReasoningParser,
    get_reasoning_parser,
)

CASES = [
    # (output, starts_in_reasoning, reasoning, content)
    (
        "<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer is 4.",
        False,
        "Step 1.\nStep 2.",
        "The answer is 4.",
    ),
    ("  \n<think>x</think>y", False, "x", "y"),
    ("<think>\n\n</think>\n\nNo reasoning.", False, "", "No reasoning."),
    ("The answer, no block.", False, "", "The answer, no block."),
    ("  Leading blanks stay\n", False, "", "  Leading blanks stay\n"),
    ("<thin", False, "", "<thin"),
    ("  ", False, "", "  "),
    ("Text then <think>late</think> tags", False, "", "Text then <think>late</think> tags"),
    ("<think>\nunclosed, cut off \n", False, "unclosed, cut off", ""),
    ("<think>\nends in a partial tag </thi", False, "ends in a partial tag </thi", ""),
    ("in the block already\n</think>\n\nanswer", True, "in the block already", "answer"),
    ("\n<think>is text here</think>\nanswer", True, "<think>is text here", "answer"),
    ("</think>answer </think> again", True, "", "answer </think> again"),
    ("never closed", True, "never closed", ""),
]


def test_registry() -> None:
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert list(REASONING_PARSERS) == ["qwen3"]
    with pytest.raises(ValueError, match=r"'deepseek_r1'.*supported: qwen3"):
        get_reasoning_parser("deepseek_r1")


@pytest.mark.parametrize(("text", "starts_in", "reasoning", "content"), CASES)
def test_extract_reasoning(text: str, starts_in: bool, reasoning: str, content: str) -> None:
    parser = Qwen3ReasoningParser(starts_in_reasoning=starts_in)
    assert parser.extract_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize(("text", "starts_in", "reasoning", "content"), CASES)
def test_every_split_streams_the_same(
    text: str, starts_in: bool, reasoning: str, content: str
) -> None:
    rng = random.Random(text)
    splits = [list(text), [text]]
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(8, len(text) - 1))))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    for pieces in splits:
        parser = Qwen3ReasoningParser(starts_in_reasoning=starts_in)
        deltas = [parser.extract_reasoning_streaming(p) for p in pieces] + [parser.finish()]
        assert "".join(d.reasoning_content for d in deltas) == reasoning
        assert "".join(d.content for d in deltas) == content


def test_streaming_releases_reasoning_before_the_block_closes() -> None:
    parser = Qwen3ReasoningParser()
    assert parser.extract_reasoning_streaming("<thi").reasoning_content == ""
    delta = parser.extract_reasoning_streaming("nk>\nFirst thought. </th")
    assert (delta.reasoning_content, delta.content) == ("First thought.", "")
    delta = parser.extract_reasoning_streaming("ink>\n\nHi")
    assert (delta.reasoning_content, delta.content) == ("", "Hi")
    assert parser.finish().content == ""
    with pytest.raises(RuntimeError):
        parser.finish()


def test_prompt_ends_in_reasoning() -> None:
    assert Qwen3ReasoningParser.prompt_ends_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not Qwen3ReasoningParser.prompt_ends_in_reasoning("<|im_start|>assistant\n")
    # enable_thinking=False: the template closes an empty block in the prompt.
    assert not Qwen3ReasoningParser.prompt_ends_in_reasoning(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
