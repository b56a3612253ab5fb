"""Reasoning parsers: split a model's output into its reasoning and its answer, whole or streamed;
an instance serves one response. Invariant: streaming is chunk-independent — feeding the output in
any pieces through `extract_reasoning_streaming` and then `finish()` yields exactly the reasoning
and content `extract_reasoning` finds in the whole text; a tail that could still become a tag is
held back until the next piece (or `finish`) decides."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(slots=True)
class ReasoningDelta:
    reasoning_content: str = ""
    content: str = ""


class ReasoningParser(ABC):
    name: ClassVar[str]

    @abstractmethod
    def extract_reasoning_streaming(self, delta_text: str) -> ReasoningDelta:
        """Consumes the next piece of output; returns what it makes certain."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """Flushes what was held back at the end of the output; the parser is then spent."""

    @classmethod
    def for_prompt(cls, prompt: str) -> ReasoningParser:
        """A parser for the output that follows the rendered `prompt`."""
        return cls()

    @abstractmethod
    def reasoning_format(self) -> dict[str, Any]:
        """The reasoning block this parser expects, as an xgrammar structural-tag format (free
        text): a grammar that puts it before a constrained answer leaves the reasoning free."""

    @abstractmethod
    def fresh(self) -> ReasoningParser:
        """A parser in this one's initial state (same options)."""

    def extract_reasoning(self, text: str) -> tuple[str, str]:
        """(reasoning_content, content) of a whole output; this parser's state is untouched."""
        parser = self.fresh()
        first = parser.extract_reasoning_streaming(text)
        last = parser.finish()
        return (
            first.reasoning_content + last.reasoning_content,
            first.content + last.content,
        )
