"""One response's output, split into reasoning, answer text and tool calls, whole or streamed. The
reasoning parser (if any) sees the raw output first; only its content reaches the tool parser, so
tags inside the reasoning are never calls. Both parsers are chunk-independent, hence so is this:
the deltas of any split of the output add up to `parse` of the whole text."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.entrypoints.openai.reasoning import ReasoningParser
from ferrum.entrypoints.openai.tool_parsers import DeltaToolCall, ToolCall, ToolParser


@dataclass(slots=True)
class ChatDelta:
    reasoning_content: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.reasoning_content or self.content or self.tool_calls)


@dataclass(slots=True)
class ParsedChat:
    reasoning_content: str
    content: str
    tool_calls: list[ToolCall]


class ChatOutputParser:
    """Per-response parser; either part may be None (that part is then passed through)."""

    def __init__(
        self, reasoning_parser: ReasoningParser | None, tool_parser: ToolParser | None
    ) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser

    def parse(self, text: str) -> ParsedChat:
        """The whole output's parts; this parser's streaming state is untouched."""
        reasoning, content = "", text
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.extract_reasoning(text)
        calls: list[ToolCall] = []
        if self.tool_parser is not None:
            content, calls = self.tool_parser.extract_tool_calls(content)
        return ParsedChat(reasoning, content, calls)

    def parse_delta(self, delta_text: str) -> ChatDelta:
        """Consumes the next piece of output; returns what it makes certain."""
        out = ChatDelta(content=delta_text)
        if self.reasoning_parser is not None:
            step = self.reasoning_parser.extract_reasoning_streaming(delta_text)
            out.reasoning_content, out.content = step.reasoning_content, step.content
        if self.tool_parser is not None and out.content:
            step = self.tool_parser.extract_tool_calls_streaming(out.content)
            out.content, out.tool_calls = step.content, step.tool_calls
        return out

    def finish(self) -> ChatDelta:
        """Flushes what both parsers held back at the end of the output."""
        out = ChatDelta()
        if self.reasoning_parser is not None:
            step = self.reasoning_parser.finish()
            out.reasoning_content, out.content = step.reasoning_content, step.content
        if self.tool_parser is not None:
            if out.content:
                step = self.tool_parser.extract_tool_calls_streaming(out.content)
                out.content, out.tool_calls = step.content, step.tool_calls
            step = self.tool_parser.finish()
            out.content += step.content
            out.tool_calls += step.tool_calls
        return out
