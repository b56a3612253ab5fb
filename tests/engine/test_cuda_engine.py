"""The GPU path end to end: Triton kernels + CUDA graphs, equal to HF (runs only with CUDA)."""

from __future__ import annotations

import pytest
import torch

from ferrum import LLM, SamplingParams
from tests.engine.test_hf_equivalence import MAX_TOKENS, greedy, random_prompts
from tests.tiny_checkpoints import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def cuda_llm(path: str, **kwargs) -> LLM:
    defaults = dict(
        skip_tokenizer_init=True,
        dtype="float32",
        device="cuda",
        block_size=16,
        max_model_len=256,
        max_num_seqs=16,
    )
    return LLM(path, **(defaults | kwargs))


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "qwen2"])
def test_graphs_and_triton_match_hf(tiny_checkpoint, arch: str) -> None:
    path = tiny_checkpoint(arch)
    llm = cuda_llm(path, num_kv_blocks=64)
    runner = llm.llm_engine.core.runner
    assert runner.kernel_backend == "triton" and runner.cuda_graphs is not None
    prompts = random_prompts([5, 40, 2, 19, 33], seed=21)
    assert greedy(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)


def test_single_request_prefill_graphs_match_hf(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    llm = cuda_llm(path, num_kv_blocks=64)
    assert llm.llm_engine.core.runner.cuda_graphs.prefill_sizes[0] == 16
    prompts = random_prompts([3, 17, 40], seed=24)
    # Alone, each prompt is one request's chunk: it runs as a prefill graph.
    assert [greedy(llm, [p])[0] for p in prompts] == hf_greedy(path, prompts, MAX_TOKENS)
    # A shared prefix makes the chunk attend over cached blocks (context longer than the chunk).
    extended = [prompts[2] + [7, 8, 9, 10, 11]]
    assert greedy(llm, extended) == hf_greedy(path, extended, MAX_TOKENS)


def test_preemption_and_chunking_on_cuda(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    llm = cuda_llm(path, num_kv_blocks=8, max_num_batched_tokens=24, enable_prefix_caching=False)
    prompts = random_prompts([23, 9, 30, 3, 11, 17], seed=22)
    assert greedy(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0


def test_eager_equals_graphs_in_bf16(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([7, 12, 30], seed=23)
    graphs = cuda_llm(path, dtype="bfloat16", num_kv_blocks=64)
    eager = cuda_llm(path, dtype="bfloat16", num_kv_blocks=64, enforce_eager=True)
    assert eager.llm_engine.core.runner.cuda_graphs is None
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
