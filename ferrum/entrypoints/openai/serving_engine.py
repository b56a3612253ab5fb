"""What the completions and chat endpoints share: model and engine checks, request
submission, error mapping, SSE framing and per-choice streaming state."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from ferrum.engine.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineNotReadyError,
    RequestStream,
)
from ferrum.engine.input_processor import PromptType
from ferrum.entrypoints.openai.protocol import (
    APIError,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
)
from ferrum.logger import init_logger
from ferrum.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from ferrum.sampling_params import SamplingParams

logger = init_logger(__name__)

_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")
# One prompt ready for the engine: (text or None, token ids).
Tokenized = tuple[str | None, list[int]]


def sse_event(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = sse_event("[DONE]")


def as_api_error(error: BaseException, param: str | None = None) -> APIError:
    """The HTTP answer to an engine-side error."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError(503, f"the engine is dead: {error}", code="engine_dead")
    if isinstance(error, EngineNotReadyError):
        return APIError(503, str(error), code="engine_loading")
    if isinstance(error, ValueError):
        return APIError(400, str(error), param=param)
    raise error


def stream_error_event(error: Exception) -> str:
    """The SSE event that ends a stream which failed after its 200 status was sent."""
    if isinstance(error, (APIError, ValueError, EngineDeadError, EngineNotReadyError)):
        api_error = as_api_error(error)
    else:
        logger.error("a stream failed", exc_info=error)
        api_error = APIError(500, f"internal error: {type(error).__name__}")
    return sse_event('{"error": ' + api_error.info.model_dump_json() + "}")


class OpenAIServing:
    """Model-name and engine-state checks, prompt length limits, request submission."""

    def __init__(self, engine: AsyncLLM, model_names: list[str]) -> None:
        self.engine = engine
        self.model_names = model_names
        # generation_config.json values: the defaults of fields a request leaves unset.
        self.defaults: dict[str, Any] = engine.config.model_config.default_sampling_kwargs()

    def check_request(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {self.model_names}",
                param="model",
                code="model_not_found",
            )
        try:
            self.engine.check_can_serve()
        except (EngineDeadError, EngineNotReadyError) as e:
            raise as_api_error(e) from None

    def tokenize(self, prompt: PromptType, param: str = "prompt") -> Tokenized:
        try:
            return self.engine.process_prompt(prompt)
        except (ValueError, EngineDeadError, EngineNotReadyError) as e:
            raise as_api_error(e, param) from None

    def max_tokens_for(self, requested: int | None, num_prompt_tokens: int, param: str) -> int:
        """`requested`, else the model's default capped by the room left for this prompt."""
        if requested is not None:
            return requested
        room = self.engine.max_tokens_room(num_prompt_tokens)
        if room < 1:
            raise APIError(
                400,
                f"prompt ({num_prompt_tokens} tokens) leaves no room for output: "
                f"{self.engine.describe_limits()}",
                param=param,
            )
        default = self.defaults.get("max_tokens")
        return room if default is None else min(int(default), room)

    def sampling_params(
        self, request: SamplingRequest, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        try:
            return request.to_sampling_params(max_tokens, logprobs, self.defaults)
        except ValueError as e:
            # SamplingParams names the field: "SamplingParams.<field> must be ...".
            field = _SAMPLING_FIELD.match(str(e))
            raise APIError(400, str(e), param=field.group(1) if field else None) from None

    def add_requests(
        self, requests: list[tuple[str, Tokenized, SamplingParams]], param: str
    ) -> list[RequestStream]:
        """Queues every request, or none: on a validation error the ones queued are aborted."""
        streams: list[RequestStream] = []
        try:
            for request_id, (text, token_ids), params in requests:
                prompt = {"prompt_token_ids": token_ids}
                if text is not None:
                    prompt["prompt"] = text
                streams.append(self.engine.add_request(request_id, prompt, params))
        except (ValueError, EngineDeadError, EngineNotReadyError) as e:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise as_api_error(e, param) from None
        return streams

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.engine.abort(stream.request_id)


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's last output; if any fails or this is cancelled, the others are cancelled
    (and so aborted in the engine)."""

    async def last(stream: RequestStream) -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        assert final is not None
        return final

    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(last(stream)) for stream in streams]
    return [task.result() for task in tasks]


def unwrap_group_error(error: BaseException) -> BaseException:
    """The first leaf of an ExceptionGroup raised by a TaskGroup."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def usage_of(
    prompts: list[Tokenized], outputs: list[RequestOutput | None], completion_tokens: int
) -> UsageInfo:
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def finite_logprob(value: float) -> float:
    """JSON has no -inf: impossible tokens get OpenAI's -9999.0."""
    return value if value > -9999.0 else -9999.0


class ChoiceState:
    """What one streamed choice has sent so far."""

    __slots__ = ("num_text", "num_tokens", "num_chunks", "finished")

    def __init__(self) -> None:
        self.num_text = 0
        self.num_tokens = 0
        self.num_chunks = 0
        self.finished = False

    def advance(
        self, completion: CompletionOutput
    ) -> tuple[str, list[int], SampleLogprobs | None, int] | None:
        """(new text, new token ids, their logprobs, text offset of the new text), or None when
        there is nothing new to send. The first call always sends (the stream's opening chunk)."""
        if self.finished:
            return None
        finished = completion.finish_reason is not None
        delta = completion.text[self.num_text :]
        if not delta and not finished and self.num_chunks > 0:
            return None
        new_token_ids = completion.token_ids[self.num_tokens :]
        logprobs = (
            completion.logprobs[self.num_tokens :] if completion.logprobs is not None else None
        )
        text_offset = self.num_text
        self.num_text = len(completion.text)
        self.num_tokens = len(completion.token_ids)
        self.num_chunks += 1
        self.finished = finished
        return delta, new_token_ids, logprobs, text_offset
