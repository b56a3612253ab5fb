"""The GPU path end to end: CUDA graphs against eager, KV sizing from GPU memory, async against
synchronous scheduling (runs only with CUDA; greedy against HF: tests/hf_equivalence)."""

from __future__ import annotations

import pytest
import torch

from ferrum import SamplingParams
from tests.utils.tiny_llm import MAX_TOKENS, cuda_llm, greedy, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_eager_equals_graphs_in_bf16(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([7, 12, 30], seed=23)
    graphs = cuda_llm(path, dtype="bfloat16", num_kv_blocks=64)
    eager = cuda_llm(path, dtype="bfloat16", num_kv_blocks=64, enforce_eager=True)
    assert eager.llm_engine.core.executor.runner.cuda_graphs is None
    assert greedy(graphs, prompts) == greedy(eager, prompts)


def test_memory_sizing_from_gpu_memory_utilization(tiny_checkpoint) -> None:
    llm = cuda_llm(tiny_checkpoint("qwen3"), gpu_memory_utilization=0.3, max_num_seqs=8)
    blocks = llm.llm_engine.core.kv_cache_manager.num_usable_blocks
    assert blocks > 1000  # a tiny model leaves most of the budget to the KV cache
    out = llm.generate(
        {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 4


def test_async_scheduling_equals_synchronous_with_graphs(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 12, 30, 3], seed=25)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, logprobs=3),
        SamplingParams(temperature=1.0, seed=8, max_tokens=9, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.8, seed=9, max_tokens=6, frequency_penalty=0.4),
    ]
    async_llm = cuda_llm(path, num_kv_blocks=64)
    assert async_llm.llm_engine.core.async_scheduling  # the default with CUDA
    sync_llm = cuda_llm(path, num_kv_blocks=64, async_scheduling=False)
    got = async_llm.generate(prompts, params, use_tqdm=False)
    expected = sync_llm.generate(prompts, params, use_tqdm=False)
    for g, e in zip(got, expected):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].logprobs == e.outputs[0].logprobs
