"""Long fresh prompts through torch's SDPA: which steps take it, and the same attention as the
paged path (the torch reference on the CPU with SDPA's math backend, the Triton kernel with
cuDNN / flash on CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

import ferrum.kernels.sdpa_prefill as sdpa_module
from ferrum.kernels.attention_ref import paged_attention_ref
from ferrum.kernels.sdpa_prefill import (
    SDPA_PREFILL_MIN_TOKENS,
    fresh_long_chunks,
    sdpa_prefill,
    takes_sdpa_prefill,
)
from ferrum.model_executor.cuda_graph import PREFILL_SIZES

MIN = SDPA_PREFILL_MIN_TOKENS


def test_graph_replayed_chunks_never_take_it() -> None:
    assert max(PREFILL_SIZES) < MIN


@pytest.mark.parametrize(
    "query_start_loc, seq_lens, expected",
    [
        ([0, MIN], [MIN], True),
        ([0, MIN, 3 * MIN], [MIN, 2 * MIN], True),
        ([0, MIN - 1], [MIN - 1], False),  # short
        ([0, MIN], [MIN + 16], False),  # a cached prefix before the chunk
        ([0, MIN, MIN + 1], [MIN, 40], False),  # a decode beside the prompt
        ([0], [], False),
    ],
)
def test_only_steps_of_whole_long_prompts(query_start_loc, seq_lens, expected) -> None:
    assert fresh_long_chunks(query_start_loc, seq_lens) is expected


def test_the_cpu_and_fp32_keep_the_paged_path() -> None:
    query = torch.zeros(MIN, 4, 64)
    assert not takes_sdpa_prefill(query, [0, MIN], [MIN])
    if torch.cuda.is_available():
        assert not takes_sdpa_prefill(query.cuda(), [0, MIN], [MIN])
        assert takes_sdpa_prefill(query.cuda().half(), [0, MIN], [MIN])
        assert not takes_sdpa_prefill(torch.zeros(MIN, 4, 264).cuda().half(), [0, MIN], [MIN])


def _problem(lengths: list[int], dtype: torch.dtype, device: str, heads=4, kv_heads=2, dim=32):
    gen = torch.Generator().manual_seed(sum(lengths))
    total = sum(lengths)
    q = torch.randn(total, heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(device, dtype)
    # The same keys and values in a paged cache of 16-token blocks, each request on its own.
    blocks = [-(-n // 16) for n in lengths]
    cache = torch.zeros(2, sum(blocks) + 1, 16, kv_heads, dim, dtype=dtype, device=device)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32, device=device)
    next_block, start = 1, 0
    for i, n in enumerate(lengths):
        ids = torch.arange(next_block, next_block + blocks[i], device=device)
        tables[i, : blocks[i]] = ids.to(torch.int32)
        slots = ids.repeat_interleave(16)[:n] * 16 + torch.arange(n, device=device) % 16
        cache[0].view(-1, kv_heads, dim)[slots] = k[start : start + n]
        cache[1].view(-1, kv_heads, dim)[slots] = v[start : start + n]
        next_block, start = next_block + blocks[i], start + n
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return q, k, v, cache, tables, starts


def test_equals_the_paged_reference_on_the_cpu() -> None:
    lengths = [37, 70]
    q, k, v, cache, tables, starts = _problem(lengths, torch.float32, "cpu")
    out = sdpa_prefill(q, k, v, starts, 0.3, torch.empty_like(q), backends=[SDPBackend.MATH])
    expected = paged_attention_ref(q, cache, tables, starts, lengths, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cudnn_or_flash_agree_with_the_triton_kernel() -> None:
    from ferrum.kernels.paged_attention import paged_attention

    lengths = [600, 1000]
    q, k, v, cache, tables, starts = _problem(lengths, torch.bfloat16, "cuda", 8, 2, 128)
    out = sdpa_prefill(q, k, v, starts, 128**-0.5, torch.empty_like(q))
    expected = paged_attention(
        q,
        cache,
        tables,
        torch.tensor(starts, dtype=torch.int32, device="cuda"),
        torch.tensor(lengths, dtype=torch.int32, device="cuda"),
        max(lengths),
        max(lengths),
        128**-0.5,
        torch.empty_like(q),
    )
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_engine_prefilling_through_sdpa_keeps_the_tokens(tiny_checkpoint, monkeypatch):
    """Long prompts (the threshold lowered to the tiny model's length, eager so no graph holds
    a prefill) through SDPA: the generated tokens are the paged-path engine's greedy choices
    after the same prefix (bf16 rounds the two paths differently, so a near-tie may flip)."""
    from tests.utils.tiny_llm import cuda_llm, greedy, random_prompts, teacher_forced_agreement

    calls = []
    real = sdpa_module.sdpa_prefill
    monkeypatch.setattr(sdpa_module, "SDPA_PREFILL_MIN_TOKENS", 64)
    monkeypatch.setattr(
        "ferrum.model_executor.layers.attention.sdpa_prefill",
        lambda *a, **kw: calls.append(1) or real(*a, **kw),
    )
    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([70, 90, 120, 150], seed=4)
    llm = cuda_llm(path, dtype="bfloat16", num_kv_blocks=128, enforce_eager=True)
    outputs = greedy(llm, prompts)
    assert calls
    monkeypatch.setattr(sdpa_module, "SDPA_PREFILL_MIN_TOKENS", 1 << 30)
    reference = cuda_llm(path, dtype="bfloat16", num_kv_blocks=128, enforce_eager=True)
    assert teacher_forced_agreement(reference, prompts, outputs) >= 0.9
