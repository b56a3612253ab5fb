"""POST /v1/completions: text or token-id prompts (one or a batch), echo, legacy logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ferrum.engine.async_llm import AsyncLLM
from ferrum.engine.input_processor import ProcessedPrompt, PromptType
from ferrum.engine.request_stream import RequestStream
from ferrum.entrypoints.openai.http_errors import APIError
from ferrum.entrypoints.openai.protocol import MAX_CHOICES, CompletionRequest
from ferrum.entrypoints.openai.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionStreamResponse,
)
from ferrum.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChoiceState,
    OpenAIServing,
    finite_logprob,
    logprob_token,
    off_loop,
    prompt_logprobs_json,
    sse_event,
    stream_error_event,
    usage_of,
)
from ferrum.outputs import CompletionOutput, PromptLogprobs, RequestOutput


def completion_logprobs(
    token_ids: list[int],
    logprobs: PromptLogprobs,
    text_offset: int,
    first_token_text: str = "",
    as_token_ids: bool = False,
) -> CompletionLogprobs:
    """OpenAI's legacy completions shape; offsets count characters from `text_offset`. A None
    entry is an echoed prompt's first token (nothing precedes it): `first_token_text`, and null
    logprobs. `as_token_ids`: tokens named "token_id:N" (offsets still count text)."""
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        if entry is None:
            result.tokens.append(logprob_token(token_id, first_token_text, as_token_ids))
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            result.text_offset.append(text_offset)
            text_offset += len(first_token_text)
            continue
        sampled = entry.get(token_id)
        token = (sampled.decoded_token if sampled else None) or ""
        result.tokens.append(logprob_token(token_id, token, as_token_ids))
        result.token_logprobs.append(finite_logprob(sampled.logprob) if sampled else None)
        result.top_logprobs.append(
            {
                logprob_token(i, lp.decoded_token, as_token_ids): finite_logprob(lp.logprob)
                for i, lp in entry.items()
            }
            if entry
            else None
        )
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


class OpenAIServingCompletion(OpenAIServing):
    def __init__(
        self, engine: AsyncLLM, model_names: list[str], as_token_ids: bool = False
    ) -> None:
        super().__init__(engine, model_names)
        # --return-tokens-as-token-ids: logprob tokens as "token_id:N".
        self.as_token_ids = as_token_ids

    async def create_completion(
        self, request: CompletionRequest
    ) -> CompletionResponse | AsyncIterator[str]:
        """The response, or (stream=True) an iterator of SSE events; raises APIError."""
        self.check_request(request.model)
        prompts = _split_prompts(request.prompt)
        if len(prompts) * request.n > MAX_CHOICES:
            raise APIError(
                400,
                f"n ({request.n}) x prompts ({len(prompts)}) = {len(prompts) * request.n} "
                f"completions exceeds the limit of {MAX_CHOICES}",
                param="n",
            )
        constraint = self.requested_constraint(request)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        tokenized = [await self.tokenize(p) for p in prompts]
        submissions = []
        for index, prompt in enumerate(tokenized):
            params = self.sampling_params(request, request.max_tokens, request.logprobs, constraint)
            if request.echo and request.logprobs is not None:
                # The echoed prompt's tokens carry logprobs too.
                params.prompt_logprobs = max(params.prompt_logprobs or 0, request.logprobs)
            submissions.append((f"{request_id}-{index}", prompt, params))
        streams = await self.add_requests(submissions, "prompt", self.constraint_param(request))
        model = request.model or self.model_names[0]
        echoes = [await self._echo_text(t) if request.echo else "" for t in tokenized]
        if request.stream:
            return self._stream(request, request_id, model, tokenized, echoes, streams)
        outputs = await self.final_outputs(streams)
        choices, num_generated = [], 0
        for prompt_index, output in enumerate(outputs):
            for completion in output.outputs:
                num_generated += len(completion.token_ids)
                choices.append(
                    self._choice(
                        request,
                        prompt_index,
                        completion,
                        echoes[prompt_index],
                        tokenized[prompt_index],
                        output.prompt_logprobs,
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=model,
            choices=choices,
            usage=usage_of(tokenized, list(outputs), num_generated),
        )

    async def _echo_text(self, prompt: ProcessedPrompt) -> str:
        if prompt.text is not None:
            return prompt.text
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return ""
        return await off_loop(len(prompt.token_ids), tokenizer.decode, prompt.token_ids, False)

    def _choice(
        self,
        request: CompletionRequest,
        prompt_index: int,
        completion: CompletionOutput,
        echo: str,
        prompt: ProcessedPrompt,
        prompt_logprobs: PromptLogprobs | None,
    ) -> CompletionChoice:
        logprobs = None
        if request.logprobs is not None and completion.logprobs is not None:
            logprobs = self._logprobs(
                request,
                prompt,
                prompt_logprobs,
                completion.token_ids,
                completion.logprobs,
                len(echo),
                with_prompt=True,
            )
        return CompletionChoice(
            index=prompt_index * request.n + completion.index,
            text=echo + completion.text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_logprobs=(
                prompt_logprobs_json(prompt_logprobs)
                if request.prompt_logprobs is not None
                else None
            ),
        )

    def _logprobs(
        self,
        request: CompletionRequest,
        prompt: ProcessedPrompt,
        prompt_logprobs: PromptLogprobs | None,
        token_ids: list[int],
        logprobs: PromptLogprobs,
        text_offset: int,
        with_prompt: bool,
    ) -> CompletionLogprobs:
        """The legacy logprobs of `token_ids` (offsets from `text_offset`), after the echoed
        prompt's when `with_prompt` (then the offsets count from the prompt's first token)."""
        if not (with_prompt and request.echo and prompt_logprobs is not None):
            return completion_logprobs(token_ids, logprobs, text_offset, "", self.as_token_ids)
        tokenizer = self.engine.tokenizer
        first = "" if tokenizer is None else tokenizer.decode(prompt.token_ids[:1], False)
        return completion_logprobs(
            prompt.token_ids + token_ids, prompt_logprobs + logprobs, 0, first, self.as_token_ids
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        model: str,
        tokenized: list[ProcessedPrompt],
        echoes: list[str],
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        # With include_usage every chunk carries "usage" (null but in the last); else none does.
        exclude = None if request.include_usage else {"usage"}

        def chunk(choices: list[CompletionChoice], **extra: Any) -> str:
            response = CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=choices, **extra
            )
            return sse_event(response.model_dump_json(exclude=exclude))

        last_outputs: list[RequestOutput | None] = [None] * len(streams)
        num_generated = 0
        try:
            for prompt_index, stream in enumerate(streams):
                states: dict[int, ChoiceState] = {}
                prompt_logprobs = None  # sent with a DELTA stream's first output
                async for output in stream:
                    last_outputs[prompt_index] = output
                    prompt_logprobs = prompt_logprobs or output.prompt_logprobs
                    choices = []
                    for completion in output.outputs:
                        choice = self._delta_choice(
                            request,
                            prompt_index,
                            completion,
                            echoes[prompt_index],
                            states,
                            tokenized[prompt_index],
                            prompt_logprobs,
                        )
                        if choice is not None:
                            choices.append(choice)
                    if choices and request.continuous_usage:
                        so_far = num_generated + sum(s.num_tokens for s in states.values())
                        yield chunk(choices, usage=usage_of(tokenized, last_outputs, so_far))
                    elif choices:
                        yield chunk(choices)
                num_generated += sum(state.num_tokens for state in states.values())
            if request.include_usage:
                yield chunk([], usage=usage_of(tokenized, last_outputs, num_generated))
        except Exception as e:
            yield stream_error_event(e)
        finally:
            self.abort(streams)
        yield SSE_DONE

    def _delta_choice(
        self,
        request: CompletionRequest,
        prompt_index: int,
        completion: CompletionOutput,
        echo: str,
        states: dict[int, ChoiceState],
        prompt: ProcessedPrompt,
        prompt_logprobs: PromptLogprobs | None,
    ) -> CompletionChoice | None:
        """The choice's news since its last chunk, or None when there is nothing to send. The
        first chunk carries the echo (and, with logprobs, the prompt's)."""
        state = states.setdefault(completion.index, ChoiceState())
        update = state.advance(completion)
        if update is None:
            return None
        delta, new_token_ids, new_logprobs, text_offset = update
        first = state.num_chunks == 1
        logprobs = None
        if request.logprobs is not None and new_logprobs is not None:
            logprobs = self._logprobs(
                request,
                prompt,
                prompt_logprobs,
                new_token_ids,
                new_logprobs,
                len(echo) + text_offset,
                with_prompt=first,
            )
        return CompletionChoice(
            index=prompt_index * request.n + completion.index,
            text=(echo if first else "") + delta,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )


def _split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in prompt]
