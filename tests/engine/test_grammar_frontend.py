"""Structured outputs through `AsyncLLM` (the engine core in its own process): the front end
compiles each grammar before the core sees the request; a bad grammar is a ValueError, either
from `compile_grammar` before anything is queued or from the stream of a request added while its
grammar compiled (failures are not cached: they compile again); good grammars are applied by the
core."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from ferrum.config import StructuredOutputsConfig
from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.arg_utils import EngineArgs
from ferrum.engine.async_llm import AsyncLLM, RequestStream
from ferrum.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "large"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}


def test_async_llm_compiles_in_the_front_end_and_the_core_applies() -> None:
    args = EngineArgs(
        model=DEFAULT_MODEL_DIR,
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=256,
        num_cpu_threads=1,  # the core's own process (see the one_torch_thread fixture)
        structured_outputs_config=StructuredOutputsConfig(disable_any_whitespace=True),
    )
    asyncio.run(_run(AsyncLLM.from_engine_args(args)))


def _params(**structured) -> SamplingParams:
    params = SamplingParams(
        temperature=0.9, seed=1, n=2, max_tokens=40,
        structured_outputs=StructuredOutputsParams(**structured),
    )  # fmt: skip
    params.output_kind = RequestOutputKind.FINAL_ONLY
    return params


async def _final(engine: AsyncLLM, request_id: str, params: SamplingParams):
    final = None
    stream: RequestStream = engine.add_request(request_id, "Once upon a time", params)
    async for output in stream:
        final = output
    return final


async def _run(engine: AsyncLLM) -> None:
    await engine.start()
    try:
        bad = _params(regex="a(b")
        with pytest.raises(ValueError, match=r"structured_outputs\.regex: invalid regex"):
            await engine.compile_grammar(bad)
        # Added while it compiles: the stream fails with the compile's error.
        with pytest.raises(ValueError, match=r"structured_outputs\.grammar: invalid EBNF"):
            await _final(engine, "bad-later", _params(grammar="root ::= missing"))
        # Held until compiled, then applied by the core; the second is a front-end cache hit.
        for request_id in ("json-1", "json-2"):
            output = await _final(engine, request_id, _params(json=SCHEMA))
            for completion in output.outputs:
                assert completion.finish_reason == "stop"
                jsonschema.validate(json.loads(completion.text), SCHEMA)
        assert engine.num_open_requests == 0
    finally:
        await engine.shutdown()
