"""Qwen3 reasoning: `<think>reasoning</think>answer`. The output opens with `<think>` (after
optional whitespace) or starts inside the block when the prompt ends in `<think>`
(`prompt_ends_in_reasoning`); otherwise (e.g. `enable_thinking=False`) it is all content. Whitespace
just inside the tags and after `</think>` is dropped, as the chat template drops it; an unclosed
block is all reasoning; tags after the block are content."""

from __future__ import annotations

import enum
from typing import Any

from ferrum.entrypoints.openai.reasoning.base import ReasoningDelta, ReasoningParser
from ferrum.entrypoints.openai.stream_text import partial_tag_len, split_trailing_space


class _Phase(enum.Enum):
    OPENING = enum.auto()  # before the first non-whitespace: a block may still open
    REASONING = enum.auto()
    CONTENT = enum.auto()


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    START_TAG = "<think>"
    END_TAG = "</think>"

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self._phase = _Phase.REASONING if starts_in_reasoning else _Phase.OPENING
        self._buffer = ""  # text not yet decided
        self._skip_space = starts_in_reasoning  # drop whitespace after a tag
        self._held_space = ""  # trailing reasoning whitespace; dropped if `</think>` follows
        self._finished = False

    @classmethod
    def prompt_ends_in_reasoning(cls, prompt: str) -> bool:
        """Whether a rendered prompt leaves the model inside an open `<think>` block."""
        return prompt.rfind(cls.START_TAG) > prompt.rfind(cls.END_TAG)

    @classmethod
    def for_prompt(cls, prompt: str) -> Qwen3ReasoningParser:
        return cls(starts_in_reasoning=cls.prompt_ends_in_reasoning(prompt))

    def reasoning_format(self) -> dict[str, Any]:
        """A `<think>` block (optional), or the rest of the block the prompt left open."""
        body = {"type": "any_text", "excludes": [self.START_TAG]}
        if self.starts_in_reasoning:
            return {"type": "tag", "begin": "", "content": body, "end": self.END_TAG}
        block = {"type": "tag", "begin": self.START_TAG, "content": body, "end": self.END_TAG}
        return {"type": "optional", "content": block}

    def fresh(self) -> Qwen3ReasoningParser:
        return Qwen3ReasoningParser(starts_in_reasoning=self.starts_in_reasoning)

    def extract_reasoning_streaming(self, delta_text: str) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("extract_reasoning_streaming called after finish()")
        self._buffer += delta_text
        out = ReasoningDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ReasoningDelta:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        out = ReasoningDelta()
        if self._phase is _Phase.REASONING:
            # An unclosed block: its partial end tag is reasoning, its trailing blanks are not.
            out.reasoning_content += split_trailing_space(self._held_space + self._buffer)[0]
        else:
            out.content += self._buffer
        self._buffer = self._held_space = ""
        return out

    def _step(self, out: ReasoningDelta) -> bool:
        """Decides what it can from the buffer; True if another step may decide more."""
        if self._skip_space:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._skip_space = False
        if self._phase is _Phase.OPENING:
            text = self._buffer.lstrip()
            if text.startswith(self.START_TAG):
                self._buffer = text[len(self.START_TAG) :]
                self._phase = _Phase.REASONING
                self._skip_space = True
                return True
            if self.START_TAG.startswith(text):
                return False  # blanks and maybe the start of `<think>`: wait
            self._phase = _Phase.CONTENT
        if self._phase is _Phase.CONTENT:
            out.content += self._buffer
            self._buffer = ""
            return False
        end = self._buffer.find(self.END_TAG)
        if end >= 0:
            out.reasoning_content += split_trailing_space(self._held_space + self._buffer[:end])[0]
            self._held_space = ""
            self._buffer = self._buffer[end + len(self.END_TAG) :]
            self._phase = _Phase.CONTENT
            self._skip_space = True
            return True
        keep = partial_tag_len(self._buffer, self.END_TAG)
        body, self._held_space = split_trailing_space(
            self._held_space + self._buffer[: len(self._buffer) - keep]
        )
        out.reasoning_content += body
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False
