"""Tool-call parsers: a model's tool calls in its output text, whole or streamed; one per response.
Invariants of every parser: streaming is chunk-independent (any pieces, then `finish()`, yield
exactly what `extract_tool_calls` finds in the whole text: a tail that could still become a tag
waits); a block starting with a complete call header (`stream_call`) is a call, its name sent at
once and its arguments as written, even invalid (as OpenAI's API); any other block is decided when
it closes, content verbatim if it does not parse; parsing never raises. Content is the text outside
parsed blocks less the whitespace before and between them or after the last (not before text)."""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ferrum.entrypoints.openai.stream_text import partial_tag_len, split_trailing_space


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(slots=True)
class DeltaToolCall:
    """One OpenAI `tool_calls` stream entry: the first for an index carries `id` and `name` (with
    empty `arguments`), the later ones carry argument text to append."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True, frozen=True)
class StreamedCall:
    """A call block's function name and the argument text its body makes certain so far."""

    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallsDelta:
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


def make_tool_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def loads_strict_json(text: str) -> Any:
    """`json.loads` that refuses NaN and Infinity (they cannot be sent on as JSON)."""
    return json.loads(text, parse_constant=_reject_constant)


def dumps_arguments(arguments: Mapping[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def function_definitions(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Function name -> its `parameters` JSON schema, from OpenAI `tools`."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}"
            )
        parameters = function.get("parameters")
        functions[function["name"]] = dict(parameters) if isinstance(parameters, Mapping) else {}
    return functions


class ToolParser(ABC):
    """Finds `START_TAG body END_TAG` call blocks; subclasses parse one block's body."""

    name: ClassVar[str]
    START_TAG: ClassVar[str] = "<tool_call>"
    END_TAG: ClassVar[str] = "</tool_call>"

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.tools = list(tools or ())
        self.functions = function_definitions(self.tools)
        self._buffer = ""  # text not yet decided
        self._in_call = False
        self._held_space = ""  # trailing content whitespace; dropped if a parsed call follows
        self._after_call = False  # a parsed call and at most whitespace since: the end drops it
        self._num_calls = 0
        self._finished = False
        # The open block's call once its header streamed (its index), and argument chars sent.
        self._streamed_index: int | None = None
        self._streamed_len = 0

    @abstractmethod
    def parse_call(self, body: str) -> tuple[str, dict[str, Any]] | None:
        """(function name, arguments) of one call block's body, or None if it does not parse."""

    def stream_call(self, body: str, final: bool) -> StreamedCall | None:
        """The call an open block's `body` (so far) makes certain, once its header is complete:
        the name, and the argument text known now (all of it when `final`: the block ended
        there). None while the header is incomplete or when the block does not start with one
        (then `parse_call` decides it when it closes). Must be a prefix property: once a body
        gives a call, every longer body gives the same name and arguments that extend these."""
        return None

    @classmethod
    @abstractmethod
    def call_format(cls, name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
        """The structural-tag `tag` format (begin, content, end) of one call to `name` as this
        parser reads it; see `tool_choice.tool_call_structural_tag`. The grammar compiler bounds
        the whitespace in its arguments (`structured_output/json_limits.py`)."""

    def extract_tool_calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; this parser's streaming state is untouched."""
        parser = type(self)(self.tools)
        first = parser.extract_tool_calls_streaming(text)
        last = parser.finish()
        calls: list[ToolCall] = []
        for delta in (*first.tool_calls, *last.tool_calls):
            if delta.id is not None:
                assert delta.name is not None
                calls.append(ToolCall(delta.id, delta.name, delta.arguments))
            else:
                previous = calls[delta.index]
                calls[delta.index] = ToolCall(
                    previous.id, previous.name, previous.arguments + delta.arguments
                )
        return first.content + last.content, calls

    def extract_tool_calls_streaming(self, delta_text: str) -> ToolCallsDelta:
        """Consumes the next piece of output; returns what it makes certain."""
        if self._finished:
            raise RuntimeError("extract_tool_calls_streaming called after finish()")
        self._buffer += delta_text
        out = ToolCallsDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ToolCallsDelta:
        """Flushes what was held back at the end of the output; the parser is then spent.

        An unclosed call block is a call if its body parses, else content."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        out = ToolCallsDelta()
        if self._in_call:
            body, self._buffer = self._buffer, ""
            self._close_call(body, out, closed=False)
        if self._buffer or not self._after_call:
            out.content += self._held_space + self._buffer
        self._buffer = self._held_space = ""
        return out

    def _step(self, out: ToolCallsDelta) -> bool:
        """Decides what it can from the buffer; True if another step may decide more."""
        if self._in_call:
            end = self._buffer.find(self.END_TAG)
            if end < 0:
                keep = partial_tag_len(self._buffer, self.END_TAG)
                call = self.stream_call(self._buffer[: len(self._buffer) - keep], final=False)
                if call is not None:
                    self._emit_streamed(call, out)
                return False
            body = self._buffer[:end]
            self._buffer = self._buffer[end + len(self.END_TAG) :]
            self._close_call(body, out, closed=True)
            return True
        start = self._buffer.find(self.START_TAG)
        if start >= 0:
            self._emit_content(self._buffer[:start], out)
            self._buffer = self._buffer[start + len(self.START_TAG) :]
            self._in_call = True
            return True
        keep = partial_tag_len(self._buffer, self.START_TAG)
        self._emit_content(self._buffer[: len(self._buffer) - keep], out)
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return False

    def _emit_content(self, text: str, out: ToolCallsDelta) -> None:
        if not text:
            return
        body, self._held_space = split_trailing_space(self._held_space + text)
        if body:
            out.content += body
            self._after_call = False

    def _emit_streamed(self, call: StreamedCall, out: ToolCallsDelta) -> None:
        """Sends the header of a call the first time, then the argument text not sent yet."""
        if self._streamed_index is None:
            self._held_space = ""  # the separator before a call
            self._streamed_index = self._num_calls
            self._num_calls += 1
            self._streamed_len = 0
            out.tool_calls.append(
                DeltaToolCall(self._streamed_index, make_tool_call_id(), call.name, "")
            )
        if len(call.arguments) > self._streamed_len:
            fragment = call.arguments[self._streamed_len :]
            out.tool_calls.append(DeltaToolCall(self._streamed_index, arguments=fragment))
            self._streamed_len = len(call.arguments)

    def _close_call(self, body: str, out: ToolCallsDelta, closed: bool) -> None:
        self._in_call = False
        call = self.stream_call(body, final=True)
        if call is not None:
            self._emit_streamed(call, out)
            self._streamed_index = None
            self._held_space = ""
            self._after_call = True
            return
        assert self._streamed_index is None, "stream_call must be a prefix property"
        # A second start tag inside the block means the first block was never closed.
        restart = body.rfind(self.START_TAG)
        if restart >= 0:
            self._emit_content(self.START_TAG + body[:restart], out)
            body = body[restart + len(self.START_TAG) :]
        try:
            parsed = self.parse_call(body)
        except (ValueError, TypeError, RecursionError):
            parsed = None
        if parsed is None:
            raw = self.START_TAG + body + (self.END_TAG if closed else "")
            out.content += self._held_space
            self._held_space = ""
            self._emit_content(raw, out)
            return
        name, arguments = parsed
        self._held_space = ""
        self._after_call = True
        index = self._num_calls
        self._num_calls += 1
        out.tool_calls.append(DeltaToolCall(index, make_tool_call_id(), name, ""))
        out.tool_calls.append(DeltaToolCall(index, arguments=dumps_arguments(arguments)))
