from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from ferrum.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref
from ferrum.kernels.fp8_quant import Fp8GroupRows, empty_group_rows, per_token_group_quant_fp8
from ferrum.kernels.paged_attention import (
    SPLIT_KV_MAX_PROGRAMS,
    SPLIT_KV_MAX_SPLITS,
    SPLIT_KV_MIN_SEQ_LEN,
    allocate_split_kv_workspace,
    default_num_splits,
    paged_attention,
    paged_attention_split_kv,
    paged_attention_unified,
    split_kv_max_programs,
    split_kv_workspace_shapes,
    use_split_kv,
    write_kv_cache,
)
from ferrum.kernels.paged_attention_common import SPLIT_KV_FP8_FACTOR

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Batch:
    """Random queries and cache; each request's blocks are scattered over a shuffled pool and
    block-table entries past the context hold -1."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(seq_lens), max(blocks_per_req) + 2), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    starts = [0, *itertools.accumulate(query_lens)]
    return Batch(
        query=query.to(device=device, dtype=dtype),
        kv_cache=kv_cache.to(device=device, dtype=dtype),
        block_tables=block_tables.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def reference(b: Batch, scale: float) -> torch.Tensor:
    return paged_attention_ref(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc_cpu, b.seq_lens_cpu, scale
    )


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


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(4, 2, 8), (8, 2, 16)])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_kv_matches_single_pass_and_reference(
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    num_splits: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    seq_lens = [1, 37, 100, 16]
    b = make_batch([1] * 4, seq_lens, num_heads, num_kv_heads, 32, block_size, dtype, device)
    ws = allocate_split_kv_workspace(6, num_heads, 32, device, max_splits=8)
    scale = 32**-0.5
    split = torch.empty_like(b.query)
    paged_attention_split_kv(
        b.query,
        b.kv_cache,
        b.block_tables,
        b.seq_lens,
        b.max_seq_len,
        scale,
        split,
        ws,
        num_splits=num_splits,
        block_n=16,
    )
    single = torch.empty_like(b.query)
    paged_attention_unified(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, 1, scale, single
    )
    torch.testing.assert_close(split, single, **TOL[dtype])
    torch.testing.assert_close(split, reference(b, scale), **TOL[dtype])


def test_dispatch_takes_split_path_for_small_long_decode_batch(device: torch.device) -> None:
    b = make_batch([1, 1], [150, 33], 4, 2, 32, 8, torch.float32, device, seed=3)
    ws = allocate_split_kv_workspace(2, 4, 32, device, max_splits=SPLIT_KV_MAX_SPLITS)
    ws.partial_sum.fill_(float("nan"))
    out = torch.empty_like(b.query)
    paged_attention(
        b.query,
        b.kv_cache,
        b.block_tables,
        b.query_start_loc,
        b.seq_lens,
        1,
        b.max_seq_len,
        0.25,
        out,
        workspace=ws,
    )
    splits = default_num_splits(2, 2, SPLIT_KV_MAX_SPLITS)
    assert splits == SPLIT_KV_MAX_SPLITS
    # Parts of whole 64-key tiles: 150 keys fill 3 parts, 33 keys one; nothing else is written.
    assert not ws.partial_sum[0, :, :3].isnan().any() and ws.partial_sum[0, :, 3:].isnan().all()
    assert not ws.partial_sum[1, :, :1].isnan().any() and ws.partial_sum[1, :, 1:].isnan().all()
    torch.testing.assert_close(out, reference(b, 0.25), **TOL[torch.float32])


def test_use_split_kv_heuristic() -> None:
    ws = allocate_split_kv_workspace(8, 4, 32, "cpu")
    assert use_split_kv(4, 4, 2, 1, 2048, ws)
    assert use_split_kv(4, 4, 2, 1, SPLIT_KV_MIN_SEQ_LEN + 1, ws)
    assert not use_split_kv(4, 4, 2, 1, SPLIT_KV_MIN_SEQ_LEN, ws)  # one pass is as fast
    assert not use_split_kv(4, 5, 2, 2, 2048, ws)  # not decode-only
    assert not use_split_kv(9, 9, 2, 1, 2048, ws)  # more requests than the workspace holds
    assert not use_split_kv(4, 4, 2, 1, 2048, None)
    many = allocate_split_kv_workspace(SPLIT_KV_MAX_PROGRAMS, 4, 32, "cpu", max_splits=1)
    assert not use_split_kv(SPLIT_KV_MAX_PROGRAMS, SPLIT_KV_MAX_PROGRAMS, 1, 1, 2048, many)


def test_fp8_caches_split_into_more_programs() -> None:
    """32 requests x 8 KV heads fill 256 single-pass programs: one pass over a bf16 cache, split
    over an FP8 one (its programs do more work per byte), into 4x the parts."""
    ws = allocate_split_kv_workspace(128, 32, 128, "cpu")
    assert not use_split_kv(32, 32, 8, 1, 8192, ws)
    assert use_split_kv(32, 32, 8, 1, 8192, ws, fp8_cache=True)
    assert not use_split_kv(128, 128, 8, 1, 8192, ws, fp8_cache=True)  # 1,024 programs
    assert split_kv_max_programs(True) == SPLIT_KV_FP8_FACTOR * split_kv_max_programs(False)
    assert default_num_splits(16, 8, 32, fp8_cache=True) == 4 * default_num_splits(16, 8, 32)


def test_default_num_splits_fills_the_gpu() -> None:
    assert default_num_splits(1, 4, 32) == 32  # batch 1 of a 4-KV-head model: 128 programs
    assert default_num_splits(8, 8, 32) == 8  # 64 programs -> 512
    assert default_num_splits(100, 8, 32) == 1
    assert default_num_splits(1, 1, 4) == 4  # capped by the workspace


def test_split_kv_workspace_shapes() -> None:
    assert split_kv_workspace_shapes(3, 8, 64, 16) == ((3, 8, 16, 64), (3, 8, 16))
    with pytest.raises(ValueError, match="max_splits"):
        split_kv_workspace_shapes(3, 8, 64, 0)
    with pytest.raises(ValueError, match="max_num_seqs"):
        split_kv_workspace_shapes(0, 8, 64)


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


def _free_blocks_below_window(b: Batch, window: int, block_size: int) -> None:
    """Points block-table entries wholly below each request's first window at a NaN block, as a
    sliding-window cache that freed them would leave them: reading one poisons the output."""
    used = set(b.block_tables.flatten().tolist())
    nan_block = min(set(range(b.kv_cache.shape[1])) - used)  # make_batch leaves 3 unused
    b.kv_cache[:, nan_block] = float("nan")
    starts = b.query_start_loc_cpu
    for i, seq_len in enumerate(b.seq_lens_cpu):
        q_len = starts[i + 1] - starts[i]
        first_key = max(0, seq_len - q_len - window + 1)
        b.block_tables[i, : first_key // block_size] = nan_block


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
    _free_blocks_below_window(b, window, 8)
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


@pytest.mark.parametrize(("window", "num_splits"), [(1, 4), (33, 3), (64, 8), (500, 2)])
def test_sliding_window_split_kv_matches_reference(
    window: int, num_splits: int, dtype: torch.dtype, device: torch.device
) -> None:
    b = make_batch([1] * 3, [1, 150, 70], 4, 2, 32, 8, dtype, device, seed=7)
    _free_blocks_below_window(b, window, 8)
    ws = allocate_split_kv_workspace(3, 4, 32, device, max_splits=8)
    out = torch.full_like(b.query, float("nan"))
    paged_attention_split_kv(
        b.query,
        b.kv_cache,
        b.block_tables,
        b.seq_lens,
        b.max_seq_len,
        0.2,
        out,
        ws,
        num_splits=num_splits,
        block_n=16,
        sliding_window=window,
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
