"""How one chat completion output becomes an OpenAI choice: whole (`response_choice`) or as the
deltas of a stream (`StreamedChoice`), with its logprobs, reasoning, content and tool calls."""

from __future__ import annotations

from ferrum.entrypoints.openai.chat_output_parser import ChatDelta, ChatOutputParser
from ferrum.entrypoints.openai.chat_protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    ToolCallFunction,
    TopLogprob,
)
from ferrum.entrypoints.openai.frontend_args import FrontendConfig
from ferrum.entrypoints.openai.serving_engine import (
    ChoiceState,
    finite_logprob,
    logprob_token,
)
from ferrum.entrypoints.openai.tool_parsers import DeltaToolCall as ParsedDeltaToolCall
from ferrum.outputs import CompletionOutput, SampleLogprobs


def chat_logprobs(
    token_ids: list[int], logprobs: SampleLogprobs, num_top: int, as_token_ids: bool = False
) -> ChatChoiceLogprobs:
    """OpenAI's chat shape: per token its logprob and the `num_top` most likely tokens
    (`as_token_ids`: tokens named "token_id:N"; `bytes` stay the text's)."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry.get(token_id)
        text = (sampled.decoded_token if sampled else None) or ""
        token = logprob_token(token_id, text, as_token_ids)
        ranked = sorted(
            entry.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30
        )
        top = [
            TopLogprob(
                token=logprob_token(i, lp.decoded_token, as_token_ids),
                logprob=finite_logprob(lp.logprob),
                bytes=list((lp.decoded_token or "").encode()),
            )
            for i, lp in ranked
            if lp.rank is not None and lp.rank <= num_top
        ]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=finite_logprob(sampled.logprob) if sampled else -9999.0,
                bytes=list(text.encode()),
                top_logprobs=top[:num_top],
            )
        )
    return ChatChoiceLogprobs(content=content)


def response_choice(
    request: ChatCompletionRequest,
    completion: CompletionOutput,
    parser: ChatOutputParser | None,
    single_call: bool,
    frontend: FrontendConfig | None = None,
    calls_only: bool = False,
) -> ChatCompletionChoice:
    """The whole choice; `frontend`: the message's role and how logprob tokens are named. With
    `calls_only` (a forced tool_choice) no content: text outside the calls can only be an
    unfinished call's markup."""
    frontend = frontend or FrontendConfig()
    logprobs = None
    if request.logprobs and completion.logprobs is not None:
        logprobs = chat_logprobs(
            completion.token_ids,
            completion.logprobs,
            request.top_logprobs or 0,
            frontend.return_tokens_as_token_ids,
        )
    message = ChatResponseMessage(role=frontend.response_role, content=completion.text)
    if parser is not None:
        parsed = parser.parse(completion.text)
        calls = parsed.tool_calls[:1] if single_call else parsed.tool_calls
        content = "" if calls_only else parsed.content
        message = ChatResponseMessage(
            role=frontend.response_role,
            content=content if content or not (calls or calls_only) else None,
            reasoning_content=parsed.reasoning_content or None,
            tool_calls=[
                ToolCall(id=c.id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
                for c in calls
            ],
        )
    return ChatCompletionChoice(
        index=completion.index,
        message=message,
        logprobs=logprobs,
        finish_reason=finish_reason_of(completion.finish_reason, bool(message.tool_calls)),
        stop_reason=completion.stop_reason,
    )


class StreamedChoice:
    """One streamed choice: what it has sent and its output parser's state; with `calls_only`
    (a forced tool_choice) it sends no content."""

    __slots__ = ("state", "parser", "single_call", "calls_only", "num_calls")

    def __init__(
        self, parser: ChatOutputParser | None, single_call: bool, calls_only: bool = False
    ) -> None:
        self.state = ChoiceState()
        self.parser = parser
        self.single_call = single_call
        self.calls_only = calls_only
        self.num_calls = 0

    def delta(self, text: str, finished: bool) -> DeltaMessage:
        """The next delta message from the next piece of output text."""
        if self.parser is None:
            return DeltaMessage(content=text) if text or not finished else DeltaMessage()
        parsed = self.parser.parse_delta(text)
        if finished:
            last = self.parser.finish()
            parsed = ChatDelta(
                parsed.reasoning_content + last.reasoning_content,
                parsed.content + last.content,
                parsed.tool_calls + last.tool_calls,
            )
        calls = [c for c in parsed.tool_calls if not (self.single_call and c.index > 0)]
        self.num_calls = max([self.num_calls] + [c.index + 1 for c in calls])
        return DeltaMessage(
            content=None if self.calls_only else parsed.content or None,
            reasoning_content=parsed.reasoning_content or None,
            tool_calls=[delta_tool_call(c) for c in calls] or None,
        )


def delta_tool_call(call: ParsedDeltaToolCall) -> DeltaToolCall:
    if call.id is not None:
        return DeltaToolCall(
            index=call.index,
            id=call.id,
            type="function",
            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )
    return DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments))


def is_empty_delta(delta: DeltaMessage) -> bool:
    return not (delta.content or delta.reasoning_content or delta.tool_calls)


def finish_reason_of(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended after calling tools."""
    return "tool_calls" if reason == "stop" and made_calls else reason
