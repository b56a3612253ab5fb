"""POST /v1/chat/completions: messages through the model's chat template, then generation."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2

from ferrum.engine.async_llm import RequestStream
from ferrum.engine.input_processor import ProcessedPrompt
from ferrum.engine.tokenizer import Tokenizer
from ferrum.entrypoints.openai.protocol import (
    APIError,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    DeltaMessage,
    TopLogprob,
)
from ferrum.entrypoints.openai.serving_engine import (
    NOT_UNICODE,
    SSE_DONE,
    ChoiceState,
    OpenAIServing,
    finite_logprob,
    is_unicode,
    off_loop,
    sse_event,
    stream_error_event,
    usage_of,
)
from ferrum.outputs import CompletionOutput, RequestOutput, SampleLogprobs

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


def chat_logprobs(
    token_ids: list[int], logprobs: SampleLogprobs, num_top: int
) -> ChatChoiceLogprobs:
    """OpenAI's chat shape: per token its logprob and the `num_top` most likely tokens."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry.get(token_id)
        token = (sampled.decoded_token if sampled else None) or ""
        ranked = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        top = [
            TopLogprob(
                token=lp.decoded_token or "",
                logprob=finite_logprob(lp.logprob),
                bytes=list((lp.decoded_token or "").encode()),
            )
            for lp in ranked
            if lp.rank is not None and lp.rank <= num_top
        ]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=finite_logprob(sampled.logprob) if sampled else -9999.0,
                bytes=list(token.encode()),
                top_logprobs=top[:num_top],
            )
        )
    return ChatChoiceLogprobs(content=content)


class OpenAIServingChat(OpenAIServing):
    async def render_messages(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ProcessedPrompt:
        """The conversation as prompt text and ids (the template holds any BOS token)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "chat needs a tokenizer (the server runs skip_tokenizer_init)")
        reserved = _RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
        if reserved:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {sorted(reserved)}",
                param="chat_template_kwargs",
            )
        conversation = [_message_dict(m) for m in messages]
        for index, message in enumerate(conversation):
            for field in ("name", "tool_call_id"):
                if field in message and not is_unicode(message[field]):
                    param = f"messages.{index}.{field}"
                    raise APIError(400, f"{param}: {NOT_UNICODE}", param=param)
        num_chars = sum(len(message["content"]) for message in conversation)
        self.check_prompt_chars(num_chars, "messages")
        text, token_ids = await off_loop(
            num_chars,
            _render_and_encode,
            tokenizer,
            conversation,
            add_generation_prompt,
            continue_final_message,
            template_kwargs or {},
        )
        return await self.tokenize({"prompt": text, "prompt_token_ids": token_ids}, "messages")

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """The response, or (stream=True) an iterator of SSE events; raises APIError."""
        self.check_request(request.model)
        if request.top_logprobs is not None and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        tokenized = await self.render_messages(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
        )
        requested = request.max_completion_tokens or request.max_tokens
        max_tokens = self.max_tokens_for(requested, len(tokenized.token_ids), "messages")
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(request, max_tokens, logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self.add_requests([(request_id, tokenized, params)], "messages")
        model = request.model or self.model_names[0]
        if request.stream:
            return self._stream(request, request_id, model, tokenized, streams[0])
        (output,) = await self.final_outputs(streams)
        choices = [self._choice(request, completion) for completion in output.outputs]
        num_generated = sum(len(c.token_ids) for c in output.outputs)
        return ChatCompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage_of([tokenized], [output], num_generated),
        )

    def _choice(
        self, request: ChatCompletionRequest, completion: CompletionOutput
    ) -> ChatCompletionChoice:
        logprobs = None
        if request.logprobs and completion.logprobs is not None:
            logprobs = chat_logprobs(
                completion.token_ids, completion.logprobs, request.top_logprobs or 0
            )
        return ChatCompletionChoice(
            index=completion.index,
            message=ChatResponseMessage(content=completion.text),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
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

        states = {index: ChoiceState() for index in range(request.n)}
        last_output: RequestOutput | None = None
        try:
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=index,
                        delta=DeltaMessage(role="assistant", content=""),
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
                    if (choice := self._delta_choice(request, completion, states)) is not None
                ]
                if choices:
                    yield chunk(choices)
            if request.include_usage:
                num_generated = sum(state.num_tokens for state in states.values())
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
        states: dict[int, ChoiceState],
    ) -> ChatCompletionStreamChoice | None:
        state = states[completion.index]
        if state.num_chunks == 0:
            # The role chunk was the opening chunk; content starts with the next one.
            state.num_chunks = 1
        update = state.advance(completion)
        if update is None:
            return None
        delta, new_token_ids, new_logprobs, _ = update
        logprobs = None
        if request.logprobs and new_logprobs is not None:
            logprobs = chat_logprobs(new_token_ids, new_logprobs, request.top_logprobs or 0)
        finished = completion.finish_reason is not None
        return ChatCompletionStreamChoice(
            index=completion.index,
            delta=DeltaMessage(content=delta) if delta or not finished else DeltaMessage(),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )


def _render_and_encode(
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any],
) -> tuple[str, list[int]]:
    """The conversation's prompt text and its ids; raises APIError (400) naming `messages`."""
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise APIError(400, f"messages: the chat template failed: {e}", param="messages") from None
    try:
        return text, tokenizer.encode(text, add_special_tokens=False)
    except ValueError as e:
        raise APIError(400, f"messages: {e}", param="messages") from None


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    result: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result
