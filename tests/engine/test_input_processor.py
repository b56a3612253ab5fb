"""InputProcessor, the one place a request is checked: prompt types and token ids, the length
limits, max_tokens and each completion's seed and stop ids resolved, errors naming their field;
and a count that a request's fit, prompt and duplicate-id checks run once, in the offline `LLM`
and through the server's front end alike."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from typing import Any

import pytest

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine import input_processor
from ferrum.engine.arg_utils import EngineArgs
from ferrum.engine.async_llm import AsyncLLM
from ferrum.engine.input_processor import InputProcessor, ProcessedPrompt
from ferrum.engine.output_processor import OutputProcessor
from ferrum.entrypoints.openai.protocol import CompletionRequest
from ferrum.entrypoints.openai.serving_completion import OpenAIServingCompletion
from ferrum.errors import FieldError
from ferrum.recovery_config import EngineRecoveryConfig
from ferrum.sampling_params import RequestOutputKind, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=64)


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    config = EngineArgs(DEFAULT_MODEL_DIR, **ENGINE).create_engine_config()  # type: ignore[arg-type]
    return InputProcessor(config.model_config, None, max_tokens_in_pool=48)


def ids(n: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": list(range(1, n + 1))}


def test_requests_that_can_never_fit_name_the_limit(processor: InputProcessor) -> None:
    with pytest.raises(FieldError, match="max_model_len=64") as caught:
        processor.process("long", ids(60), SamplingParams(max_tokens=10))
    assert caught.value.field == "prompt"
    with pytest.raises(FieldError, match="KV cache capacity of 48 tokens"):
        processor.process("big", ids(40), SamplingParams(max_tokens=10))
    with pytest.raises(FieldError, match="leaves no room for output") as caught:
        processor.process("full", ids(48), SamplingParams(max_tokens=None))
    assert caught.value.field == "prompt"


def test_unset_max_tokens_takes_the_default_capped_by_the_room_left(
    processor: InputProcessor,
) -> None:
    def max_tokens(default: int | None, **params: Any) -> int:
        request = processor.process(
            "r", ids(40), SamplingParams(max_tokens=None, **params), default_max_tokens=default
        )
        return request.core_requests[0].sampling_params.max_tokens

    assert max_tokens(None) == 8  # the pool's 48 tokens less the prompt's 40
    assert max_tokens(5) == 5 and max_tokens(100) == 8 and max_tokens(5.0) == 5
    with pytest.raises(FieldError, match=r"max_tokens must be an integer >= 1, got 0"):
        max_tokens(0)  # a generation_config.json asking for no tokens
    with pytest.raises(FieldError, match=r"min_tokens must be <= max_tokens=8") as caught:
        max_tokens(None, min_tokens=9)
    assert caught.value.field == "min_tokens"


def test_logprobs_past_max_logprobs_are_refused() -> None:
    args = EngineArgs(DEFAULT_MODEL_DIR, max_logprobs=2, **ENGINE)  # type: ignore[arg-type]
    limited = InputProcessor(args.create_engine_config().model_config, None, 48)
    limited.process("ok", ids(3), SamplingParams(logprobs=2, prompt_logprobs=2))
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(FieldError, match=f"{name}: 3 exceeds max_logprobs=2") as caught:
            limited.process("r", ids(3), SamplingParams(**{name: 3}))
        assert caught.value.field == name


def test_completions_are_resolved_and_the_user_params_left_alone(
    processor: InputProcessor,
) -> None:
    params = SamplingParams(n=3, seed=7, max_tokens=4, stop_token_ids=[9])
    before = repr(params)
    request = processor.process("r", ids(3), params, output_kind=RequestOutputKind.FINAL_ONLY)
    assert [r.req_id for r in request.core_requests] == ["0#r", "1#r", "2#r"]
    assert [r.sampling_params.seed for r in request.core_requests] == [7, 8, 9]
    stops = request.core_requests[0].sampling_params.all_stop_token_ids
    assert 9 in stops and set(processor.eos_token_ids) <= stops
    assert request.output_kind is RequestOutputKind.FINAL_ONLY
    assert request.params is params and repr(params) == before
    ignoring = processor.process("e", ids(3), SamplingParams(ignore_eos=True, stop_token_ids=[9]))
    assert ignoring.core_requests[0].sampling_params.all_stop_token_ids == {9}


@pytest.mark.parametrize(
    ("prompt", "error", "field"),
    [
        (123, TypeError, None),
        ({"text": "x"}, TypeError, None),
        ({"prompt_token_ids": None}, TypeError, None),
        ({"prompt_token_ids": [1, "2"]}, FieldError, "prompt_token_ids"),
        ({"prompt_token_ids": []}, FieldError, "prompt"),
        ({"prompt_token_ids": [1, 10**9]}, FieldError, "prompt_token_ids"),
        ("text without a tokenizer", FieldError, "prompt"),
    ],
)
def test_bad_prompts_name_their_field(
    processor: InputProcessor, prompt: Any, error: type, field: str | None
) -> None:
    with pytest.raises(error) as caught:
        processor.process("r", prompt, SamplingParams())
    assert getattr(caught.value, "field", None) == field


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(logit_bias={10**9: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[10**9]), "allowed_token_ids"),
        (SamplingParams(stop=["x"]), "stop"),
        (SamplingParams(bad_words=["x"]), "bad_words"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
    ],
)
def test_bad_token_fields_name_their_field(
    processor: InputProcessor, params: Any, field: str
) -> None:
    with pytest.raises(FieldError) as caught:
        processor.process("r", ids(3), params() if callable(params) else params)
    assert caught.value.field == field


class CheckCounter:
    """Counts the fit, prompt and duplicate-id checks wherever the package calls them: every
    loaded ferrum module's `check_request_fits` is replaced."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter[str] = Counter()
        original_fits = input_processor.check_request_fits
        original_prompt = InputProcessor.process_prompt
        original_add = OutputProcessor.add_request

        def fits(*args: Any) -> None:
            self.counts["fit"] += 1
            original_fits(*args)

        def process_prompt(processor: InputProcessor, prompt: Any) -> ProcessedPrompt:
            if not isinstance(prompt, ProcessedPrompt):
                self.counts["prompt"] += 1
            return original_prompt(processor, prompt)

        def add_request(processor: OutputProcessor, request: Any) -> None:
            self.counts["duplicate"] += 1
            original_add(processor, request)

        for name, module in list(sys.modules.items()):
            if name.startswith("ferrum") and getattr(module, "check_request_fits", None):
                monkeypatch.setattr(module, "check_request_fits", fits)
        monkeypatch.setattr(InputProcessor, "process_prompt", process_prompt)
        monkeypatch.setattr(OutputProcessor, "add_request", add_request)


def test_each_request_is_checked_once_offline(shipped_llm, monkeypatch) -> None:
    counter = CheckCounter(monkeypatch)
    params = [SamplingParams(max_tokens=2), SamplingParams(n=3, seed=1, max_tokens=2)]
    shipped_llm.generate(["Once upon a time", "The river"], params, use_tqdm=False)
    assert counter.counts == {"fit": 2, "prompt": 2, "duplicate": 2}


def test_each_request_is_checked_once_by_the_server_front_end(monkeypatch) -> None:
    config = EngineArgs(DEFAULT_MODEL_DIR, **ENGINE).create_engine_config()  # type: ignore[arg-type]

    async def main() -> Counter[str]:
        engine = AsyncLLM(config, EngineRecoveryConfig())
        await engine.start()
        try:
            counter = CheckCounter(monkeypatch)
            serving = OpenAIServingCompletion(engine, ["m"])
            request = CompletionRequest(prompt=["Once upon", "a time"], max_tokens=2, n=2)
            response = await serving.create_completion(request)
            assert len(response.choices) == 4  # type: ignore[union-attr]
            return counter.counts
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == {"fit": 2, "prompt": 2, "duplicate": 2}
