"""Greedy tokens through the whole engine equal Hugging Face transformers' on the same checkpoint.

Tiny random fp32 checkpoints of each architecture (tests/utils/tiny_checkpoints.py) go through the
scheduler, paged KV cache, runner and sampler: a plain batch with prefix-cache hits, chunked
prefill with preemption, synchronous and async scheduling, the torch and Triton kernel backends on
the CPU, CUDA graphs on a GPU. The shipped trained model is compared last.
"""

from __future__ import annotations

import pytest
import torch

from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR
from tests.utils.tiny_checkpoints import ARCHS, hf_greedy
from tests.utils.tiny_llm import MAX_TOKENS, cuda_llm, greedy, make_llm, random_prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# The Triton interpreter runs the kernels on the CPU only where no GPU is (tests/conftest.py).
needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton CPU interpreter: the CUDA tests cover the GPU"
)
# "mistral" without a window is Llama's forward; its logits are checked in test_model_logits.
# Qwen3.5 (hybrid: prefix hits only on state snapshots) has its own file, test_qwen3_5.py.
SYNC = [
    pytest.param(arch, False, id=arch)
    for arch in ARCHS
    if arch != "mistral" and not arch.startswith("qwen3_5")
]


@pytest.mark.parametrize(
    ("arch", "async_scheduling"),
    SYNC + [pytest.param(arch, True, id=f"{arch}-async") for arch in ("llama", "qwen3")],
)
def test_batch_and_prefix_hits_match_hf(tiny_checkpoint, arch: str, async_scheduling) -> None:
    path = tiny_checkpoint(arch)
    prompts = random_prompts([5, 17, 2, 30], seed=1)
    llm = make_llm(path, num_kv_blocks=128, async_scheduling=async_scheduling)
    assert llm.llm_engine.core.async_scheduling == async_scheduling
    assert greedy(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)

    # Same prefixes, new suffixes: the shared full blocks come from the prefix cache.
    kv = llm.llm_engine.core.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    extended = [p + s for p, s in zip(prompts, random_prompts([3, 9, 6, 1], seed=2))]
    assert greedy(llm, extended) == hf_greedy(path, extended, MAX_TOKENS)
    assert kv.prefix_cache_hits - hits_before >= 4 + 16 + 28
    assert kv.usage == 0.0


@pytest.mark.parametrize(
    ("arch", "async_scheduling"), SYNC + [pytest.param("qwen3", True, id="qwen3-async")]
)
def test_chunked_prefill_and_preemption_match_hf(
    tiny_checkpoint, arch: str, async_scheduling
) -> None:
    path = tiny_checkpoint(arch)
    prompts = random_prompts([23, 9, 14, 3, 11], seed=3)
    # 16 usable blocks of 4 tokens: each request fits alone (<= 9 blocks), not all at once. A
    # sliding-window-only model holds at most 4 blocks per request (window 6, chunks of 7): 8.
    llm = make_llm(
        path,
        num_kv_blocks=9 if arch == "mistral_sw" else 17,
        max_num_batched_tokens=7,
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )
    assert greedy(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert llm.llm_engine.core.kv_cache_manager.usage == 0.0


def test_sliding_window_requests_outgrow_the_pool_and_hit_inside_the_window(
    tiny_checkpoint,
) -> None:
    """A sliding-window group releases the blocks that left the window: a request longer than
    the whole pool runs, and a prefix hit whose early blocks were evicted (only the window's
    blocks are cached) gives the tokens of a cold run."""
    path = tiny_checkpoint("mistral_sw")
    # 12 usable blocks = 48 tokens; the long request reaches 69, but a sliding group holds at
    # most 4 blocks of it (window 6, chunks of 7).
    llm = make_llm(path, num_kv_blocks=13, max_num_batched_tokens=7, max_model_len=80)
    kv = llm.llm_engine.core.kv_cache_manager
    prompts = random_prompts([13, 21, 59], seed=4)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    assert greedy(llm, prompts) == expected
    # The long prompt again: 14 of its blocks hit though the pool holds 12 (the first ones,
    # released first, were evicted first).
    hits_before = kv.prefix_cache_hits
    assert greedy(llm, prompts[2:]) == expected[2:]
    assert kv.prefix_cache_hits - hits_before == 56
    assert kv.usage == 0.0


@needs_interpreter
@pytest.mark.parametrize("arch", ["llama3", "qwen3", "qwen3_moe", "gemma3"])
def test_triton_kernels_match_hf(tiny_checkpoint, arch: str) -> None:
    pytest.importorskip("triton")
    path = tiny_checkpoint(arch)
    prompts = random_prompts([6, 13, 2], seed=11)
    # Chunked prefill + prefix hits + decodes all go through the Triton kernels.
    llm = make_llm(path, kernel_backend="triton", num_kv_blocks=64, max_num_batched_tokens=9)
    assert llm.llm_engine.core.executor.runner.kernel_backend == "triton"
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    assert greedy(llm, prompts) == expected
    # Served from the prefix cache: its first token comes from a prefill over cached blocks, the
    # next ones from decode steps over them (the interpreter's decode steps are the first round's).
    assert greedy(llm, prompts[:1], max_tokens=3) == [expected[0][:3]]


@needs_cuda
@pytest.mark.parametrize("arch", ["llama3", "qwen3", "qwen2", "mistral_sw", "gemma3"])
def test_cuda_graphs_and_triton_match_hf(tiny_checkpoint, arch: str) -> None:
    path = tiny_checkpoint(arch)
    llm = cuda_llm(path, num_kv_blocks=64)
    runner = llm.llm_engine.core.executor.runner
    assert runner.kernel_backend == "triton" and runner.cuda_graphs is not None
    prompts = random_prompts([5, 40, 2, 19, 33], seed=21)
    assert greedy(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)


@needs_cuda
def test_cuda_single_request_prefill_graphs_match_hf(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    llm = cuda_llm(path, num_kv_blocks=64)
    assert llm.llm_engine.core.executor.runner.cuda_graphs.prefill_sizes[0] == 16
    prompts = random_prompts([3, 17, 40], seed=24)
    # Alone, each prompt is one request's chunk: it runs as a prefill graph.
    assert [greedy(llm, [p])[0] for p in prompts] == hf_greedy(path, prompts, MAX_TOKENS)
    # A shared prefix makes the chunk attend over cached blocks (context longer than the chunk).
    extended = [prompts[2] + [7, 8, 9, 10, 11]]
    assert greedy(llm, extended) == hf_greedy(path, extended, MAX_TOKENS)


@needs_cuda
def test_cuda_preemption_and_chunking_match_hf(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    llm = cuda_llm(path, num_kv_blocks=8, max_num_batched_tokens=24, enable_prefix_caching=False)
    prompts = random_prompts([23, 9, 30, 3, 11, 17], seed=22)
    assert greedy(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0


def test_shipped_model_greedy_equals_transformers(shipped_llm: LLM) -> None:
    prompts = ["To create a new table,", "A database index is", "The Python interpreter"]
    tokenizer = shipped_llm.get_tokenizer()
    ids = [tokenizer.encode(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = shipped_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(DEFAULT_MODEL_DIR, ids, 16)
    # The trained model writes English words, not noise.
    words = " ".join(o.outputs[0].text for o in outputs).lower().split()
    assert sum(w in {"the", "a", "is", "to", "of", "table"} for w in words) >= 5
