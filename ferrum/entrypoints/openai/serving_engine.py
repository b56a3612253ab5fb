"""What the completions and chat endpoints share: model and engine checks, request
submission, error mapping, SSE framing and per-choice streaming state."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from ferrum.engine.async_llm import AsyncLLM
from ferrum.engine.errors import EngineDeadError, EngineNotReadyError, RequestCrashedEngineError
from ferrum.engine.input_processor import ProcessedPrompt, PromptType
from ferrum.engine.request_stream import RequestStream
from ferrum.entrypoints.openai.http_errors import APIError
from ferrum.entrypoints.openai.lora_routes import REQUEST_LORA, lora_for_model
from ferrum.entrypoints.openai.protocol import SamplingRequest
from ferrum.entrypoints.openai.responses import (
    PromptLogprob,
    PromptLogprobsJSON,
    PromptTokensDetails,
    UsageInfo,
)
from ferrum.entrypoints.openai.structured_outputs import requested_constraint
from ferrum.errors import FieldError
from ferrum.logger import init_logger
from ferrum.outputs import CompletionOutput, PromptLogprobs, RequestOutput, SampleLogprobs
from ferrum.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = init_logger(__name__)

T = TypeVar("T")

# The engine's names for a prompt's parts; an error naming one names the request's prompt field.
_PROMPT_FIELDS = frozenset({"prompt", "prompt_token_ids"})

NOT_UNICODE = "not valid Unicode text (it holds a lone surrogate such as \\ud800)"


def is_unicode(text: str) -> bool:
    """False for text with lone surrogates: JSON can carry them, UTF-8 cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# Work on inputs at least this big (characters or token ids) runs in a worker thread: one huge
# request never stalls the event loop, /health and other streams (the tokenizer releases the GIL
# for such inputs). Smaller inputs take well under a millisecond and stay on the loop.
OFF_LOOP_MIN_SIZE = 4096


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, in the default executor when `size` >= OFF_LOOP_MIN_SIZE."""
    if size < OFF_LOOP_MIN_SIZE:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def _prompt_size(prompt: PromptType) -> int:
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        return len(ids) if isinstance(ids, list) else len(prompt.get("prompt") or "")
    return 0


def sse_event(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = sse_event("[DONE]")


def as_api_error(error: BaseException, prompt_param: str | None = None) -> APIError:
    """The HTTP answer to an engine-side error; `prompt_param`: the request field that holds
    the prompt ("prompt", "messages")."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError(503, f"the engine is dead: {error}", code="engine_dead")
    if isinstance(error, EngineNotReadyError):
        return APIError(503, str(error), code="engine_loading")
    if isinstance(error, RequestCrashedEngineError):
        return APIError(500, str(error), code="request_crashed_engine")
    if isinstance(error, FieldError):
        param = prompt_param if error.field in _PROMPT_FIELDS else error.field
        return APIError(400, str(error), param=param)
    if isinstance(error, ValueError):
        return APIError(400, str(error), param=prompt_param)
    raise error


def stream_error_event(error: Exception) -> str:
    """The SSE event that ends a stream which failed after its 200 status was sent."""
    known = (APIError, ValueError, EngineDeadError, EngineNotReadyError, RequestCrashedEngineError)
    if isinstance(error, known):
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
        """A served model name (a base name or a LoRA adapter's: that adapter then runs the
        request's completions, `REQUEST_LORA`) and an engine that can serve."""
        if model is not None and not is_unicode(model):
            raise APIError(400, f"model: {NOT_UNICODE}", param="model")
        lora = lora_for_model(self.engine, model)
        if model is not None and lora is None and model not in self.model_names:
            served = self.model_names + list(self.engine.loras.by_name)
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        REQUEST_LORA.set(lora)
        try:
            self.engine.check_can_serve()
        except (EngineDeadError, EngineNotReadyError) as e:
            raise as_api_error(e) from None

    async def tokenize(self, prompt: PromptType, param: str = "prompt") -> ProcessedPrompt:
        """The prompt's ids; a big prompt is tokenized in a worker thread."""
        try:
            processor = self.engine.check_can_serve()
            return await off_loop(_prompt_size(prompt), processor.process_prompt, prompt)
        except (ValueError, EngineDeadError, EngineNotReadyError) as e:
            raise as_api_error(e, param) from None

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """400 when a text of `num_chars` characters cannot fit in max_model_len tokens."""
        try:
            self.engine.check_can_serve().check_prompt_chars(num_chars, param)
        except (ValueError, EngineDeadError, EngineNotReadyError) as e:
            raise as_api_error(e, param) from None

    def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """A stream consumes DELTA outputs; a plain response waits for the final one. Unset
        `max_tokens` is resolved when the request is added (the model's default, capped by the
        room the prompt leaves)."""
        try:
            params = request.to_sampling_params(
                max_tokens, logprobs, self.defaults, structured_outputs
            )
        except ValueError as e:
            raise as_api_error(e) from None
        stream = bool(request.stream)
        params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        return params

    @staticmethod
    def requested_constraint(request: SamplingRequest) -> StructuredOutputsParams | None:
        """The request's response_format / structured_outputs as engine params; raises APIError."""
        try:
            return requested_constraint(request.response_format, request.structured_outputs)
        except ValueError as e:
            raise APIError(400, str(e), param=OpenAIServing.constraint_param(request)) from None

    @staticmethod
    def constraint_param(request: SamplingRequest) -> str:
        """The request field its output constraint came from."""
        return "structured_outputs" if request.structured_outputs else "response_format"

    async def add_requests(
        self,
        requests: list[tuple[str, ProcessedPrompt, SamplingParams]],
        param: str,
        constraint_param: str | None = None,
    ) -> list[RequestStream]:
        """Compiles the requests' grammars, then queues every request, or none: a grammar that
        is invalid or misses the compile timeout is a 400 naming `constraint_param` before
        anything is queued or streamed; on a validation error the ones queued are aborted."""
        compiled: set[int] = set()
        for _, _, params in requests:
            constraint = params.structured_outputs
            if constraint is None or id(constraint) in compiled:
                continue
            try:
                await self.engine.compile_grammar(params)
            except ValueError as e:
                raise APIError(400, str(e), param=constraint_param) from None
            compiled.add(id(constraint))
        streams: list[RequestStream] = []
        try:
            default_max_tokens = self.defaults.get("max_tokens")
            for request_id, prompt, params in requests:
                stream = self.engine.add_request(
                    request_id, prompt, params, default_max_tokens, lora_request=REQUEST_LORA.get()
                )
                streams.append(stream)
        except (ValueError, EngineDeadError, EngineNotReadyError) as e:
            for stream in streams:
                self.engine.abort(stream.request_id)
            raise as_api_error(e, param) from None
        return streams

    def abort(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            self.engine.abort(stream.request_id)

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """Each stream's last output. If any fails or this is cancelled, every request is
        aborted; an engine-side error is raised as its APIError."""
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(_last_output(stream)) for stream in streams]
        except BaseException as e:
            self.abort(streams)
            error = e
            while isinstance(error, BaseExceptionGroup):
                error = error.exceptions[0]
            if isinstance(error, asyncio.CancelledError):
                raise
            raise as_api_error(error) from None
        return [task.result() for task in tasks]


async def _last_output(stream: RequestStream) -> RequestOutput:
    final = None
    async for output in stream:
        final = output
    assert final is not None
    return final


def usage_of(
    prompts: list[ProcessedPrompt], outputs: list[RequestOutput | None], completion_tokens: int
) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
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


def logprob_token(token_id: int, decoded: str | None, as_token_id: bool) -> str:
    """A logprob entry's token: its text, or "token_id:N" (--return-tokens-as-token-ids)."""
    return f"token_id:{token_id}" if as_token_id else decoded or ""


def prompt_logprobs_json(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsJSON | None:
    """vLLM's prompt_logprobs response field."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(token_id): PromptLogprob(
                logprob=finite_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]


class ChoiceState:
    """What one streamed choice has sent so far, and the tokens held back with no text yet."""

    __slots__ = ("num_text", "num_tokens", "num_chunks", "finished", "token_ids", "logprobs")

    def __init__(self) -> None:
        self.num_text = 0
        self.num_tokens = 0
        self.num_chunks = 0
        self.finished = False
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs = []

    def advance(
        self, delta: CompletionOutput
    ) -> tuple[str, list[int], SampleLogprobs | None, int] | None:
        """Takes the choice's next DELTA output; returns (new text, new token ids, their
        logprobs, text offset of the new text), or None when there is nothing to send yet (the
        tokens wait for their text). The first call always sends (the stream's opening chunk)."""
        if self.finished:
            return None
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)
        finished = delta.finish_reason is not None
        if not delta.text and not finished and self.num_chunks > 0:
            return None
        token_ids, self.token_ids = self.token_ids, []
        logprobs, self.logprobs = self.logprobs, []
        text_offset = self.num_text
        self.num_text += len(delta.text)
        self.num_tokens += len(token_ids)
        self.num_chunks += 1
        self.finished = finished
        return delta.text, token_ids, logprobs if delta.logprobs is not None else None, text_offset
