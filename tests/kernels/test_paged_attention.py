from __future__ import annotations

import pytest
import torch

from ferrum.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref
from ferrum.kernels.fp8_quant import Fp8GroupRows, empty_group_rows, per_token_group_quant_fp8
from ferrum.kernels.paged_attention import (
    allocate_split_kv_workspace,
    paged_attention,
    paged_attention_split_kv,
    paged_attention_unified,
    write_kv_cache,
)
from tests.utils.paged_batches import TOL, free_blocks_below_window, make_batch, reference


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 32, 8), (8, 2, 64, 16), (6, 2, 32, 16), (4, 4, 64, 8)],
)
def test_mixed_batch_matches_reference(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    # A decode over a 1-token context, a 7-token chunk over a 23-token prefix, a 13-token chunk
    # over 32 cached tokens, and a 5-token prompt with no prefix.
    b = make_batch(
        [1, 7, 13, 5], [1, 30, 45, 5], num_heads, num_kv_heads, head_dim, block_size, dtype, device
    )
    scale = head_dim**-0.5
    out = torch.full_like(b.query, float("nan"))
    got = paged_attention(
        b.query,
        b.kv_cache,
        b.block_tables,
        b.query_start_loc,
        b.seq_lens,
        b.max_query_len,
        b.max_seq_len,
        scale,
        out,
    )
    assert got is out
    torch.testing.assert_close(out, reference(b, scale), **TOL[dtype])


def test_long_chunk_spans_several_query_tiles(device: torch.device) -> None:
    # 40 tokens x GQA 4 = 160 rows: more than one 128-row tile.
    b = make_batch([40, 2], [70, 9], 8, 2, 32, 16, torch.float32, device, seed=1)
    out = torch.empty_like(b.query)
    paged_attention_unified(
        b.query,
        b.kv_cache,
        b.block_tables,
        b.query_start_loc,
        b.seq_lens,
        b.max_query_len,
        0.3,
        out,
    )
    torch.testing.assert_close(out, reference(b, 0.3), **TOL[torch.float32])


def test_padded_requests_and_upper_bound_lengths(device: torch.device) -> None:
    # CUDA-graph style: a trailing request with no query tokens, max lengths given as bounds.
    b = make_batch([3, 1, 0], [20, 11, 4], 4, 1, 32, 8, torch.float32, device, seed=2)
    out = torch.zeros_like(b.query)
    paged_attention_unified(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, 4, 0.2, out
    )
    torch.testing.assert_close(out, reference(b, 0.2), **TOL[torch.float32])


def test_launcher_validation_errors() -> None:
    b = make_batch([2, 1], [5, 9], 4, 2, 32, 8, torch.float32, torch.device("cpu"))
    out = torch.empty_like(b.query)
    args = dict(
        query=b.query,
        kv_cache=b.kv_cache,
        block_tables=b.block_tables,
        query_start_loc=b.query_start_loc,
        seq_lens=b.seq_lens,
        max_query_len=2,
        scale=1.0,
        out=out,
    )
    bad = {
        "query": b.query.to(torch.float64),
        "kv_cache": b.kv_cache.to(torch.float16),
        "block_tables": b.block_tables.long(),
        "query_start_loc": b.query_start_loc[:2],
        "seq_lens": b.seq_lens.long(),
        "out": out[:, :2],
        "max_query_len": 4,
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            paged_attention_unified(**{**args, name: value})
    with pytest.raises(ValueError, match="head_dim"):
        q = torch.zeros(3, 4, 24)
        cache = torch.zeros(2, 4, 8, 2, 24)
        paged_attention_unified(**{**args, "query": q, "kv_cache": cache, "out": q.clone()})
    with pytest.raises(ValueError, match="block_size"):
        cache = torch.zeros(2, 4, 6, 2, 32)
        paged_attention_unified(**{**args, "kv_cache": cache})
    with pytest.raises(ValueError, match="num_kv_heads"):
        cache = torch.zeros(2, 4, 8, 3, 32)
        paged_attention_unified(**{**args, "kv_cache": cache})

    ws = allocate_split_kv_workspace(1, 4, 32, "cpu", max_splits=4)
    with pytest.raises(ValueError, match="one token per request"):
        paged_attention_split_kv(b.query, b.kv_cache, b.block_tables, b.seq_lens, 9, 1.0, out, ws)
    q1 = b.query[:2]
    with pytest.raises(ValueError, match="max_num_seqs"):
        paged_attention_split_kv(q1, b.kv_cache, b.block_tables, b.seq_lens, 9, 1.0, q1, ws)
    ws2 = allocate_split_kv_workspace(2, 4, 32, "cpu", max_splits=4)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_split_kv(
            q1, b.kv_cache, b.block_tables, b.seq_lens, 9, 1.0, q1, ws2, num_splits=5
        )
    with pytest.raises(ValueError, match="block_n"):
        paged_attention_split_kv(
            q1, b.kv_cache, b.block_tables, b.seq_lens, 9, 1.0, q1, ws2, block_n=24
        )
    ws3 = allocate_split_kv_workspace(2, 8, 32, "cpu")
    with pytest.raises(ValueError, match="workspace"):
        paged_attention_split_kv(q1, b.kv_cache, b.block_tables, b.seq_lens, 9, 1.0, q1, ws3)


def test_write_kv_cache_matches_reference(dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(4)
    num_tokens, num_kv_heads, head_dim = 5, 3, 24
    # key and value are strided views into one fused projection output.
    kv = torch.randn(num_tokens, 2 * num_kv_heads * head_dim + 7, generator=gen)
    kv = kv.to(device=device, dtype=dtype)
    key = kv[:, : num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = kv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(
        num_tokens, num_kv_heads, head_dim
    )
    cache = torch.randn(2, 4, 8, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    slots = torch.tensor([3, 17, 8, 31, 0], dtype=torch.int64, device=device)
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots)
    write_kv_cache(key, value, cache, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_write_kv_cache_skips_negative_slots(device: torch.device) -> None:
    key = torch.ones(3, 2, 16, device=device)
    cache = torch.zeros(2, 2, 8, 2, 16, device=device)
    slots = torch.tensor([5, -1, 9], dtype=torch.int64, device=device)
    write_kv_cache(key, 2 * key, cache, slots)
    flat = cache.view(2, -1, 2, 16)
    assert flat[0, 5].eq(1).all() and flat[1, 9].eq(2).all()
    assert flat[:, [s for s in range(16) if s not in (5, 9)]].eq(0).all()


def test_write_kv_cache_validation_errors() -> None:
    key = torch.zeros(3, 2, 16)
    cache = torch.zeros(2, 2, 8, 2, 16)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(key, key, cache, slots.int())
    with pytest.raises(ValueError, match="value"):
        write_kv_cache(key, key.half(), cache, slots)
    with pytest.raises(ValueError, match="kv_cache"):
        write_kv_cache(key, key, torch.zeros(2, 2, 8, 3, 16), slots)
    with pytest.raises(ValueError, match="key"):
        write_kv_cache(key.transpose(1, 2), key, cache, slots)


def test_reference_sliding_window_matches_transformers_mask() -> None:
    masking = pytest.importorskip("transformers.masking_utils")
    window = 5
    b = make_batch([9, 1], [20, 13], 2, 1, 16, 4, torch.float32, torch.device("cpu"), seed=5)
    got = paged_attention_ref(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc_cpu, b.seq_lens_cpu, 0.5, window
    )
    mask_fn = masking.sliding_window_causal_mask_function(window)
    for i, seq_len in enumerate(b.seq_lens_cpu):
        start, end = b.query_start_loc_cpu[i], b.query_start_loc_cpu[i + 1]
        blocks = b.block_tables[i, : -(-seq_len // 4)].long()
        k = b.kv_cache[0, blocks].reshape(-1, 16)[:seq_len]
        v = b.kv_cache[1, blocks].reshape(-1, 16)[:seq_len]
        q_idx = torch.arange(seq_len - (end - start), seq_len)[:, None]
        allowed = mask_fn(0, 0, q_idx, torch.arange(seq_len)[None, :])
        for h in range(2):
            scores = (b.query[start:end, h] @ k.T * 0.5).masked_fill(~allowed, float("-inf"))
            expected = torch.softmax(scores, -1) @ v
            torch.testing.assert_close(got[start:end, h], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 24, 200])
def test_sliding_window_unified_matches_reference(
    window: int, dtype: torch.dtype, device: torch.device
) -> None:
    # Chunks that start before, inside and past the window; a decode far past it.
    b = make_batch([1, 7, 40, 5], [90, 30, 45, 5], 4, 2, 32, 8, dtype, device, seed=6)
    free_blocks_below_window(b, window, 8)
    out = torch.full_like(b.query, float("nan"))
    paged_attention_unified(
        b.query,
        b.kv_cache,
        b.block_tables,
        b.query_start_loc,
        b.seq_lens,
        b.max_query_len,
        0.2,
        out,
        sliding_window=window,
        block_n=16,
    )
    expected = paged_attention_ref(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc_cpu, b.seq_lens_cpu, 0.2, window
    )
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_sliding_window_wider_than_context_changes_nothing(device: torch.device) -> None:
    b = make_batch([3, 1], [20, 11], 4, 2, 32, 8, torch.float32, device, seed=8)
    args = (b.query, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, 3, 0.3)
    plain = paged_attention_unified(*args, torch.empty_like(b.query))
    windowed = paged_attention_unified(*args, torch.empty_like(b.query), sliding_window=20)
    torch.testing.assert_close(windowed, plain, atol=0, rtol=0)


def test_sliding_window_dispatch_and_validation(device: torch.device) -> None:
    # A decode batch over long contexts but a short window: the window decides the path.
    b = make_batch([1, 1], [300, 200], 4, 2, 32, 8, torch.float32, device, seed=9)
    ws = allocate_split_kv_workspace(2, 4, 32, device)
    ws.partial_sum.fill_(float("nan"))
    args = (b.query, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, 1, 300, 0.3)
    out = paged_attention(*args, torch.empty_like(b.query), ws, sliding_window=16)
    assert ws.partial_sum.isnan().all()  # one pass over 16 keys: the unified path
    expected = paged_attention_ref(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc_cpu, b.seq_lens_cpu, 0.3, 16
    )
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    out = paged_attention(*args, torch.empty_like(b.query), ws, sliding_window=256)
    assert not ws.partial_sum.isnan().all()
    expected = paged_attention_ref(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc_cpu, b.seq_lens_cpu, 0.3, 256
    )
    torch.testing.assert_close(out, expected, **TOL[torch.float32])
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="sliding_window"):
            paged_attention(*args, torch.empty_like(b.query), ws, sliding_window=bad)


def _assert_fp8_heads(rows: Fp8GroupRows, out: torch.Tensor) -> None:
    """The FP8 rows are out's [tokens, heads * 128] view quantized per token-group, bit for bit
    (the separate pass runs the same conversion, so this holds under the CPU interpreter too)."""
    q, scales = per_token_group_quant_fp8(out.reshape(out.shape[0], -1))
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(rows.scales, scales, rtol=0, atol=0)


@pytest.mark.parametrize("window", [None, 32], ids=["full", "window32"])
@pytest.mark.parametrize("path", ["unified", "split"])
def test_fp8_output_rows_are_the_outputs_quantization(
    path: str, window: int | None, device: torch.device
) -> None:
    """Heads of 128: each head is one quantization group of the o_proj input, so the kernels
    quantize their own output; a mixed batch takes the unified kernel, a decode batch with a
    workspace the split-KV reduce; also over a sliding window (Gemma 3's local layers)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    query_lens = [1, 5, 1] if path == "unified" else [1, 1, 1]
    b = make_batch(query_lens, [9, 21, 300], 4, 2, 128, 16, dtype, device, seed=5)
    workspace = allocate_split_kv_workspace(4, 4, 128, device) if path == "split" else None
    rows = empty_group_rows(b.query.shape[0], 4 * 128, device)
    args = (b.query, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens)
    lengths = (b.max_query_len, b.max_seq_len)
    out = torch.empty_like(b.query)
    paged_attention(*args, *lengths, 0.1, out, workspace, sliding_window=window, out_fp8=rows)
    plain = torch.empty_like(b.query)
    paged_attention(*args, *lengths, 0.1, plain, workspace, sliding_window=window)
    assert torch.equal(out, plain)
    _assert_fp8_heads(rows, out)


def test_fp8_output_rows_need_heads_of_128(device: torch.device) -> None:
    b = make_batch([1, 2], [4, 6], 4, 2, 64, 8, torch.float16, device)
    rows = empty_group_rows(3, 256, device)
    out = torch.empty_like(b.query)
    with pytest.raises(ValueError, match="head_dim == 128"):
        paged_attention_unified(
            b.query, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, 2, 0.1, out,
            out_fp8=rows,
        )  # fmt: skip
    b = make_batch([1, 2], [4, 6], 4, 2, 128, 8, torch.float16, device)
    out = torch.empty_like(b.query)
    with pytest.raises(ValueError, match="out_fp8 must be"):
        paged_attention_unified(
            b.query, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, 2, 0.1, out,
            out_fp8=empty_group_rows(2, 512, device),
        )  # fmt: skip
