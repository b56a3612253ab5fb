"""POST /v1/chat/completions: messages (and tools) through the chat template, generation, then
the output split into reasoning, answer text and tool calls (ChatOutputParser), whole or streamed
(each choice built by chat_choices.py).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import jinja2

from ferrum.engine.async_llm import AsyncLLM
from ferrum.engine.input_processor import ProcessedPrompt
from ferrum.engine.request_stream import RequestStream
from ferrum.engine.tokenizer import Tokenizer
from ferrum.entrypoints.openai.chat_choices import (
    StreamedChoice,
    chat_logprobs,
    finish_reason_of,
    is_empty_delta,
    response_choice,
)
from ferrum.entrypoints.openai.chat_output_parser import ChatOutputParser
from ferrum.entrypoints.openai.chat_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
    TokenizeChatRequest,
    message_dict,
)
from ferrum.entrypoints.openai.frontend_args import FrontendConfig
from ferrum.entrypoints.openai.http_errors import APIError
from ferrum.entrypoints.openai.reasoning import ReasoningParser, get_reasoning_parser
from ferrum.entrypoints.openai.serving_engine import (
    NOT_UNICODE,
    SSE_DONE,
    OpenAIServing,
    is_unicode,
    off_loop,
    prompt_logprobs_json,
    sse_event,
    stream_error_event,
    usage_of,
)
from ferrum.entrypoints.openai.structured_outputs import after_reasoning
from ferrum.entrypoints.openai.tool_messages import decode_tool_call_arguments
from ferrum.entrypoints.openai.tool_parsers import HermesToolParser, ToolParser, get_tool_parser
from ferrum.entrypoints.openai.tool_parsers.tool_choice import (
    auto_tool_call_structural_tag,
    tool_call_structural_tag,
)
from ferrum.logger import init_logger
from ferrum.outputs import CompletionOutput, RequestOutput
from ferrum.sampling_params import SamplingParams, StructuredOutputsParams

# apply_chat_template arguments a request may not set through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
    }
)

logger = init_logger(__name__)


@dataclass(frozen=True, slots=True)
class ChatPlan:
    """How one request's output is parsed: the parsers' classes (None: that part is off),
    whether only the first tool call is kept (parallel_tool_calls=false), and whether the output
    is tool calls only (a forced tool_choice: any other text is an unfinished call, not content)."""

    reasoning_parser: type[ReasoningParser] | None
    tool_parser: type[ToolParser] | None
    single_call: bool
    tools: list[dict[str, Any]] | None
    # What the output must match (tool calls or the requested format), if anything.
    constraint: StructuredOutputsParams | None
    # The request field the constraint comes from (named by a 400 when its grammar fails).
    constraint_param: str
    calls_only: bool = False

    def output_constraint(self, prompt: ProcessedPrompt) -> StructuredOutputsParams | None:
        """The constraint as the engine applies it: after the reasoning when a reasoning
        parser is on (the reasoning itself stays free)."""
        if self.constraint is None or self.reasoning_parser is None:
            return self.constraint
        parser = self.reasoning_parser.for_prompt(prompt.text or "")
        return after_reasoning(self.constraint, parser.reasoning_format())

    def output_parser(self, prompt: ProcessedPrompt) -> ChatOutputParser | None:
        """A fresh parser for one choice's output, or None when the output is all content."""
        if self.reasoning_parser is None and self.tool_parser is None:
            return None
        reasoning = (
            None
            if self.reasoning_parser is None
            else self.reasoning_parser.for_prompt(prompt.text or "")
        )
        tools = None if self.tool_parser is None else self.tool_parser(self.tools)
        return ChatOutputParser(reasoning, tools)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self, engine: AsyncLLM, model_names: list[str], frontend: FrontendConfig | None = None
    ) -> None:
        super().__init__(engine, model_names)
        self.frontend = frontend or FrontendConfig()
        self.reasoning_parser = (
            None
            if self.frontend.reasoning_parser is None
            else get_reasoning_parser(self.frontend.reasoning_parser)
        )
        self.tool_parser = (
            None
            if self.frontend.tool_call_parser is None
            else get_tool_parser(self.frontend.tool_call_parser)
        )

    async def render(self, request: ChatCompletionRequest | TokenizeChatRequest) -> ProcessedPrompt:
        """The conversation (and its tools) as prompt text and ids; a big conversation is
        rendered and tokenized in a worker thread."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "chat needs a tokenizer (the server runs skip_tokenizer_init)")
        template_kwargs = request.chat_template_kwargs or {}
        reserved = _RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs)
        if reserved:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {sorted(reserved)}",
                param="chat_template_kwargs",
            )
        if request.chat_template is not None and not self.frontend.trust_request_chat_template:
            raise APIError(
                400,
                "chat_template in a request needs a server started with "
                "--trust-request-chat-template",
                param="chat_template",
            )
        conversation = decode_tool_call_arguments([message_dict(m) for m in request.messages])
        for index, message in enumerate(conversation):
            for field in ("name", "tool_call_id"):
                if field in message and not is_unicode(message[field]):
                    param = f"messages.{index}.{field}"
                    raise APIError(400, f"{param}: {NOT_UNICODE}", param=param)
        num_chars = sum(len(message["content"]) for message in conversation)
        self.check_prompt_chars(num_chars, "messages")
        render_kwargs = {
            "add_generation_prompt": request.add_generation_prompt,
            "continue_final_message": request.continue_final_message,
            "tools": request.tool_dicts(),
            "chat_template": request.chat_template or self.frontend.chat_template,
            **template_kwargs,
        }
        add_special_tokens = getattr(request, "add_special_tokens", False)
        text, token_ids = await off_loop(
            num_chars,
            _render_and_encode,
            tokenizer,
            conversation,
            render_kwargs,
            add_special_tokens,
        )
        return await self.tokenize({"prompt": text, "prompt_token_ids": token_ids}, "messages")

    def plan(self, request: ChatCompletionRequest) -> ChatPlan:
        """Checks tools, tool_choice and the output constraint against the server's flags;
        raises APIError."""
        tool_choice = request.effective_tool_choice
        tools = request.tool_dicts()
        requested = self.requested_constraint(request)
        parallel = request.parallel_tool_calls is not False
        tool_parser: type[ToolParser] | None = None
        tool_tag = None
        if tool_choice == "auto" and request.tools:
            if not self.frontend.enable_auto_tool_choice or self.tool_parser is None:
                raise APIError(
                    400,
                    'tool_choice "auto" needs a server started with --enable-auto-tool-choice '
                    "and --tool-call-parser",
                    param="tool_choice",
                )
            tool_parser = self.tool_parser
            if requested is None:  # else the requested format constrains the output instead
                try:
                    tool_tag = auto_tool_call_structural_tag(tool_parser, tools, parallel)
                except ValueError as e:
                    raise APIError(400, str(e), param="tools") from None
        elif tool_choice != "none" and tool_choice != "auto":
            # The grammar forces the configured parser's syntax (hermes when none is set): the
            # calls parse whatever the model was trained on.
            tool_parser = self.tool_parser or HermesToolParser
            try:
                tool_tag = tool_call_structural_tag(tool_parser, tools, tool_choice, parallel)
            except ValueError as e:
                raise APIError(400, str(e), param="tool_choice") from None
            if requested is not None:
                raise APIError(
                    400,
                    f"tool_choice {tool_choice!r} forces tool calls: it cannot be combined with "
                    "response_format or structured_outputs",
                    param="tool_choice",
                )
        forced = tool_tag is not None and tool_choice != "auto"
        param = self.constraint_param(request) if tool_tag is None else _tool_param(tool_choice)
        try:  # the tag holds the tools' schemas: their limits (depth) are checked here
            constraint = (
                requested if tool_tag is None else StructuredOutputsParams(structural_tag=tool_tag)
            )
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        return ChatPlan(
            self.reasoning_parser, tool_parser, not parallel, tools, constraint, param, forced
        )

    async def _auto_calls_or_free(
        self,
        request: ChatCompletionRequest,
        params: SamplingParams,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> SamplingParams:
        """tool_choice "auto" constrains calls by the tools' schemas where xgrammar compiles
        them; where it does not (a feature it lacks), the calls go unconstrained, as before."""
        try:
            await self.engine.compile_grammar(params)
        except ValueError as e:
            logger.warning("tool_choice auto: tool calls left unconstrained: %s", e)
            return self.sampling_params(request, max_tokens, logprobs, None)
        return params

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or (stream=True) an iterator of SSE events; raises APIError."""
        self.check_request(request.model)
        plan = self.plan(request)
        tokenized = await self.render(request)
        max_tokens = request.max_completion_tokens or request.max_tokens
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        try:
            constraint = plan.output_constraint(tokenized)
        except ValueError as e:
            raise APIError(400, str(e), param="structured_outputs") from None
        params = self.sampling_params(request, max_tokens, logprobs, constraint)
        if plan.constraint_param == "tools" and constraint is not None:
            params = await self._auto_calls_or_free(request, params, max_tokens, logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        submission = (request_id, tokenized, params)
        streams = await self.add_requests([submission], "messages", plan.constraint_param)
        model = request.model or self.model_names[0]
        if request.stream:
            return self._stream(request, plan, request_id, model, tokenized, streams[0])
        (output,) = await self.final_outputs(streams)
        choices = [
            response_choice(
                request,
                completion,
                plan.output_parser(tokenized),
                plan.single_call,
                self.frontend,
                calls_only=plan.calls_only,
            )
            for completion in output.outputs
        ]
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage_of([tokenized], [output], num_generated),
            prompt_logprobs=prompt_logprobs_json(output.prompt_logprobs),
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        plan: ChatPlan,
        request_id: str,
        model: str,
        tokenized: ProcessedPrompt,
        stream: RequestStream,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        # With include_usage every chunk carries "usage" (null but in the last); else none does.
        exclude = None if request.include_usage else {"usage"}

        def chunk(choices: list[ChatCompletionStreamChoice], **extra: Any) -> str:
            response = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices, **extra
            )
            return sse_event(response.model_dump_json(exclude=exclude))

        choices_state = {
            index: StreamedChoice(plan.output_parser(tokenized), plan.single_call, plan.calls_only)
            for index in range(request.n)
        }
        last_output: RequestOutput | None = None
        try:
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=index,
                        delta=DeltaMessage(role=self.frontend.response_role, content=""),
                        logprobs=None,
                        finish_reason=None,
                    )
                    for index in range(request.n)
                ]
            )
            async for output in stream:
                last_output = output
                choices = [
                    choice
                    for completion in output.outputs
                    if (choice := self._delta_choice(request, completion, choices_state))
                    is not None
                ]
                if choices and request.continuous_usage:
                    so_far = sum(c.state.num_tokens for c in choices_state.values())
                    yield chunk(choices, usage=usage_of([tokenized], [output], so_far))
                elif choices:
                    yield chunk(choices)
            if request.include_usage:
                num_generated = sum(c.state.num_tokens for c in choices_state.values())
                yield chunk([], usage=usage_of([tokenized], [last_output], num_generated))
        except Exception as e:
            yield stream_error_event(e)
        finally:
            self.abort([stream])
        yield SSE_DONE

    def _delta_choice(
        self,
        request: ChatCompletionRequest,
        completion: CompletionOutput,
        choices_state: dict[int, StreamedChoice],
    ) -> ChatCompletionStreamChoice | None:
        streamed = choices_state[completion.index]
        state = streamed.state
        if state.num_chunks == 0:
            # The role chunk was the opening chunk; content starts with the next one.
            state.num_chunks = 1
        update = state.advance(completion)
        if update is None:
            return None
        text, new_token_ids, new_logprobs, _ = update
        finished = completion.finish_reason is not None
        delta = streamed.delta(text, finished)
        logprobs = None
        if request.logprobs and new_logprobs is not None:
            logprobs = chat_logprobs(
                new_token_ids,
                new_logprobs,
                request.top_logprobs or 0,
                self.frontend.return_tokens_as_token_ids,
            )
        if not finished and logprobs is None and is_empty_delta(delta):
            return None
        return ChatCompletionStreamChoice(
            index=completion.index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish_reason_of(completion.finish_reason, streamed.num_calls > 0),
            stop_reason=completion.stop_reason,
        )


def _tool_param(tool_choice: Any) -> str:
    """The field a tool-call grammar that fails is blamed on: the tools' schemas under "auto"."""
    return "tools" if tool_choice == "auto" else "tool_choice"


def _render_and_encode(
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    render_kwargs: dict[str, Any],
    add_special_tokens: bool,
) -> tuple[str, list[int]]:
    """The conversation's prompt text and its ids; raises APIError (400) naming `messages`."""
    try:
        text = tokenizer.apply_chat_template(conversation, **render_kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise APIError(400, f"messages: the chat template failed: {e}", param="messages") from None
    try:
        return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except ValueError as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
