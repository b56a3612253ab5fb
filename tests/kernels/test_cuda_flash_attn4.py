"""FlashAttention-4 on the GPU (runs only with CUDA, flash-attn-4 installed and a Hopper or
Blackwell GPU): the adapter against ferrum's paged Triton kernel on a mixed step at Qwen3-8B's
heads, with and without a sliding window; and engines whose long chunks attend through it (full
attention and Gemma 3's sliding layers) agree with ferrum's own kernels under teacher forcing."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.flash_attn4 import FlashAttention4, flash_attn4_rejects, load_flash_attn4
from tests.utils.tiny_llm import cuda_llm, greedy, random_prompts, teacher_forced_agreement

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or load_flash_attn4()[0] is None
    or flash_attn4_rejects(torch.cuda.get_device_capability(), torch.bfloat16, torch.bfloat16, 128)
    is not None,
    reason="needs CUDA, flash-attn-4 and a GPU it runs on",
)


@pytest.mark.parametrize("sliding_window", [None, 512])
def test_adapter_matches_the_paged_kernel(sliding_window: int | None) -> None:
    """Decodes, a chunk after a cached prefix and a fresh prompt in one step; pages of 16."""
    from ferrum.kernels.paged_attention import paged_attention_unified

    gen = torch.Generator(device="cuda").manual_seed(0)
    block, heads, kv_heads, dim = 16, 32, 8, 128
    chunks, contexts = [1, 1100, 1500, 1], [700, 4100, 1500, 3000]
    blocks = [-(-n // block) for n in contexts]
    pool = (torch.randperm(sum(blocks), device="cuda", generator=gen) + 1).int()
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32, device="cuda")
    for i, (n, start) in enumerate(zip(blocks, [0, *torch.tensor(blocks).cumsum(0).tolist()])):
        tables[i, :n] = pool[start : start + n]
    kv_cache = torch.randn(
        2, sum(blocks) + 1, block, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen
    )
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(
        int(starts[-1]), heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen
    )
    args = (query, kv_cache, tables, starts.cuda(), torch.tensor(contexts).int().cuda())
    ours = FlashAttention4(load_flash_attn4()[0])(*args, max(chunks), dim**-0.5, sliding_window)
    expected = paged_attention_unified(
        *args, max(chunks), dim**-0.5, torch.empty_like(query), sliding_window=sliding_window
    )
    assert (ours.float() - expected.float()).abs().max().item() < 2e-2


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_engine_agrees_with_ferrum_kernels(tiny_checkpoint, arch: str) -> None:  # noqa: ANN001
    """Prompts of 1,100-3,000 tokens, one after a cached prefix of another; the steps with enough
    prompt attention (a fresh 3,000-token prompt alone is 4.5M pairs) go through FlashAttention-4
    (counted); bf16, so the two kernels round differently: teacher-forced agreement."""
    path = tiny_checkpoint(arch, max_position_embeddings=4096)
    shared = random_prompts([2000], seed=3)[0]
    prompts = random_prompts([1100, 3000], seed=4) + [shared, shared + random_prompts([1200], 5)[0]]
    kwargs = dict(
        dtype="bfloat16", max_model_len=4096, max_num_batched_tokens=4096,
        kv_cache_memory_bytes=1 << 30,
    )  # fmt: skip
    flash = cuda_llm(path, attention_backend="FLASH_ATTN", **kwargs)
    kernel = _layers(flash)[0].flash_attention
    assert kernel is not None and all(m.flash_attention is kernel for m in _layers(flash))
    calls, inner = [], kernel.varlen_func
    kernel.varlen_func = lambda *args, **kw: (calls.append(kw["max_seqlen_q"]), inner(*args, **kw))[
        1
    ]
    outputs = greedy(flash, prompts)
    assert calls
    reference = cuda_llm(path, attention_backend="TRITON_ATTN", **kwargs)
    assert all(m.flash_attention is None for m in _layers(reference))
    assert teacher_forced_agreement(reference, prompts, outputs) >= 0.95


def _layers(llm):  # noqa: ANN001, ANN202
    from ferrum.model_executor.layers.attention import Attention

    runner = llm.llm_engine.core.executor.runner
    return [m for m in runner.model.modules() if isinstance(m, Attention)]
