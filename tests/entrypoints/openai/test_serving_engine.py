"""Request submission shared by the endpoints: grammars compile before anything is queued."""

from __future__ import annotations

import asyncio

import pytest

from ferrum.engine.input_processor import ProcessedPrompt
from ferrum.entrypoints.openai.http_errors import APIError
from ferrum.entrypoints.openai.serving_engine import OpenAIServing
from ferrum.sampling_params import SamplingParams, StructuredOutputsParams

TIMEOUT = "structured_outputs.regex: the grammar did not compile within the 0.05 s limit"


class _Engine:
    """Records compiles and queued requests; the grammar "slow" misses its compile timeout."""

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.queued: list[str] = []

    async def compile_grammar(self, params: SamplingParams) -> None:
        assert params.structured_outputs is not None
        self.compiled.append(params.structured_outputs.regex)
        if params.structured_outputs.regex == "slow":
            raise ValueError(TIMEOUT)

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        default_max_tokens: int | None = None,
        lora_request: object = None,
    ):
        self.queued.append(request_id)
        return request_id


def _serving(engine: _Engine) -> OpenAIServing:
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.engine = engine  # type: ignore[assignment]
    serving.defaults = {}
    return serving


def _submissions(regex: str, num_prompts: int) -> list:
    constraint = StructuredOutputsParams(regex=regex)
    prompt = ProcessedPrompt("x", [1, 2])
    return [
        (f"r{i}", prompt, SamplingParams(structured_outputs=constraint)) for i in range(num_prompts)
    ]


def test_a_grammar_past_its_compile_timeout_is_400_and_nothing_is_queued() -> None:
    engine = _Engine()
    with pytest.raises(APIError) as caught:
        asyncio.run(
            _serving(engine).add_requests(_submissions("slow", 2), "prompt", "response_format")
        )
    assert caught.value.status_code == 400
    assert caught.value.info.param == "response_format"
    assert TIMEOUT in caught.value.info.message
    assert engine.queued == []


def test_one_compile_per_shared_constraint_then_every_request_is_queued() -> None:
    engine = _Engine()
    streams = asyncio.run(_serving(engine).add_requests(_submissions("[ab]", 3), "prompt"))
    assert engine.compiled == ["[ab]"]
    assert streams == engine.queued == ["r0", "r1", "r2"]
