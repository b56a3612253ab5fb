"""An FP8 KV cache end to end on the CPU (torch kernels): the pool holds a block per byte where a
float32 cache holds one per four bytes (twice the tokens of a bfloat16 one), and greedy decoding
stays on the full-precision path's tokens."""

from __future__ import annotations

import pytest
import torch

from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR

ENGINE = dict(
    device="cpu",
    dtype="float32",
    kernel_backend="torch",
    max_model_len=256,
    kv_cache_memory_bytes=4 << 20,
    num_cpu_threads=1,
)


def test_fp8_pool_holds_four_times_the_float32_tokens_and_greedy_tokens_match() -> None:
    auto = LLM(DEFAULT_MODEL_DIR, **ENGINE)
    fp8 = LLM(DEFAULT_MODEL_DIR, kv_cache_dtype="fp8", **ENGINE)
    pools = [llm.llm_engine.core.kv_cache_manager.groups[0].block_pool for llm in (auto, fp8)]
    assert pools[1].num_blocks == 4 * pools[0].num_blocks
    prompts = ["The history of the river", "Once upon a time, a small"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in auto.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in fp8.generate(prompts, params, use_tqdm=False)]
    # Rounding the cache to e4m3 may flip a near-tie late in a sequence, never the start.
    for e, g in zip(expected, got):
        assert g[:6] == e[:6]
    auto.shutdown()
    fp8.shutdown()


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "bfloat16"])
def test_unsupported_kv_cache_dtypes_are_named(value: str) -> None:
    with pytest.raises(ValueError, match=rf"kv_cache_dtype: must be one of .*got '{value}'"):
        LLM(DEFAULT_MODEL_DIR, kv_cache_dtype=value, **ENGINE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter runs without CUDA")
def test_fp8_kv_cache_refuses_the_triton_interpreter() -> None:
    with pytest.raises(ValueError, match="Triton's CPU interpreter does not convert FP8"):
        LLM(DEFAULT_MODEL_DIR, kv_cache_dtype="fp8", **(ENGINE | {"kernel_backend": "triton"}))
