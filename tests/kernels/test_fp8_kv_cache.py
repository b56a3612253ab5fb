"""The FP8 (e4m3, scale 1.0) KV cache: the torch reference on every machine; the Triton cache
writers and both attention kernels on CUDA only (Triton's CPU interpreter does not convert FP8)."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels import FP8_KV_DTYPE
from ferrum.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref
from ferrum.kernels.paged_attention import (
    allocate_split_kv_workspace,
    paged_attention_split_kv,
    paged_attention_unified,
    write_kv_cache,
)
from ferrum.kernels.rotary_kv import rotary_kv
from tests.kernels.test_paged_attention import make_batch

cuda_only = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton's CPU interpreter does not convert FP8"
)


def _fp8_copy(kv_cache: torch.Tensor) -> torch.Tensor:
    return kv_cache.to(FP8_KV_DTYPE)


def test_reference_write_saturates_and_rounds_like_a_cast() -> None:
    cache = torch.zeros(2, 4, 4, 1, 4, dtype=FP8_KV_DTYPE)
    key = torch.tensor([[[1.0, 500.0, -1000.0, 0.1]]]).repeat(2, 1, 1)
    value = -key
    write_kv_cache_ref(key, value, cache, torch.tensor([5, 14]))
    flat = cache.float().view(2, -1, 1, 4)
    expected = torch.tensor([1.0, 448.0, -448.0, 0.1015625])
    for slot in (5, 14):
        assert torch.equal(flat[0, slot, 0], expected)
        assert torch.equal(flat[1, slot, 0], -expected)
    assert flat[:, [0, 1, 2, 3, 4, 6]].abs().sum() == 0


def test_reference_attention_over_fp8_is_close_to_full_precision() -> None:
    b = make_batch([5, 1, 17], [30, 9, 40], 8, 2, 64, 16, torch.float32, torch.device("cpu"))
    full = paged_attention_ref(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc_cpu, b.seq_lens_cpu, 0.125
    )
    fp8 = paged_attention_ref(
        b.query, _fp8_copy(b.kv_cache), b.block_tables, b.query_start_loc_cpu, b.seq_lens_cpu, 0.125
    )
    # e4m3 keeps 3 mantissa bits: each cached element is off by up to 1/16 of itself. Outputs
    # of unit-variance data are O(1); their error stays near that bound at worst and far below
    # it on average (the rounding errors of many keys and values cancel).
    error = (fp8 - full).abs()
    assert error.max() < 0.15
    assert error.mean() < 0.02


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernels_over_fp8_match_the_reference(dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    b = make_batch([5, 1, 17, 1], [30, 9, 40, 300], 8, 2, 128, 16, dtype, device)
    cache = _fp8_copy(b.kv_cache)
    query = b.query
    expected = paged_attention_ref(
        query, cache, b.block_tables, b.query_start_loc_cpu, b.seq_lens_cpu, 0.1
    )
    out = torch.empty_like(query)
    paged_attention_unified(
        query, cache, b.block_tables, b.query_start_loc, b.seq_lens, b.max_query_len, 0.1, out
    )
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    decode = make_batch([1, 1, 1], [40, 700, 9], 8, 2, 128, 16, dtype, device, seed=1)
    cache = _fp8_copy(decode.kv_cache)
    expected = paged_attention_ref(
        decode.query,
        cache,
        decode.block_tables,
        decode.query_start_loc_cpu,
        decode.seq_lens_cpu,
        0.1,
    )
    workspace = allocate_split_kv_workspace(3, 8, 128, device, max_splits=4)
    out = torch.empty_like(decode.query)
    paged_attention_split_kv(
        decode.query,
        cache,
        decode.block_tables,
        decode.seq_lens,
        decode.max_seq_len,
        0.1,
        out,
        workspace,
        num_splits=4,
    )
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@cuda_only
def test_cache_writers_store_what_the_reference_stores() -> None:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    key = (torch.randn(20, 2, 64, generator=gen) * 100).to(device, torch.bfloat16)
    value = (torch.randn(20, 2, 64, generator=gen) * 100).to(device, torch.bfloat16)
    slots = torch.randperm(64, generator=gen)[:20].to(device)
    expected = torch.zeros(2, 4, 16, 2, 64, dtype=FP8_KV_DTYPE, device=device)
    write_kv_cache_ref(key, value, expected, slots)
    cache = torch.zeros_like(expected)
    write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    # The fused RoPE + write with an identity rotation stores the same key and value.
    cache.zero_()
    cos = torch.ones(20, 32, device=device)
    sin = torch.zeros(20, 32, device=device)
    query = torch.zeros(20, 4, 64, device=device, dtype=torch.bfloat16)
    rotary_kv(query, key.clone(), value, cos, sin, cache, slots)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
