"""Triton paged attention over the block-table KV cache, and the KV-cache write.

KV cache, per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (0 keys, 1 values); slot
s is block `s // block_size`, offset `s % block_size`. Same math as `paged_attention_ref`. The
unified path is one launch for mixed batches (prompt chunks over a cached prefix plus decodes): a
program owns one KV head group and a tile of one request's query tokens, its rows (token, query
head) pairs, so each KV tile is loaded once per group. Small decode-only batches over long contexts
take split-KV (paged_attention_split_kv.py). Either can write its output quantized per 128-group
(`out_fp8`, heads of 128), the rows an FP8 o_proj reads in place of its own quantization pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FP8_KV_DTYPE
from ferrum.kernels.fp8_quant import Fp8GroupRows
from ferrum.kernels.kv_cache_write import write_kv_cache
from ferrum.kernels.paged_attention_common import (
    _LOG2E,
    _NEG_BIG,
    SPLIT_KV_MAX_PROGRAMS,
    SPLIT_KV_MAX_SPLITS,
    SPLIT_KV_MIN_SEQ_LEN,
    _attend_kv_range,
    _check_attention_args,
    _check_block_n,
    _dot_precision,
    _window_constexpr,
    check_fp8_out,
    split_kv_max_programs,
    store_fp8_heads,
)
from ferrum.kernels.paged_attention_split_kv import paged_attention_split_kv
from ferrum.kernels.split_kv_plan import (
    SplitKVWorkspace,
    allocate_split_kv_workspace,
    default_num_splits,
    split_kv_workspace_shapes,
    use_split_kv,
)

__all__ = [
    "SPLIT_KV_MAX_PROGRAMS",
    "SPLIT_KV_MAX_SPLITS",
    "SPLIT_KV_MIN_SEQ_LEN",
    "SplitKVWorkspace",
    "allocate_split_kv_workspace",
    "default_num_splits",
    "paged_attention",
    "paged_attention_split_kv",
    "paged_attention_unified",
    "split_kv_max_programs",
    "split_kv_workspace_shapes",
    "use_split_kv",
    "write_kv_cache",
]


# The block table's row stride (the step's widest table) takes any value, so Triton would compile a
# variant per "1 / multiple of 16 / other" class of it at each tile config. The metadata pointers
# and FP8 rows' scales may be slices at any request (a step split around SDPA's prompts), so their
# alignment is not specialised either (read or written an element or a few at a time).
@triton.jit(
    do_not_specialize=("stride_bt_req",),
    do_not_specialize_on_alignment=(
        "block_tables_ptr",
        "query_start_loc_ptr",
        "seq_lens_ptr",
        "q8_scale_ptr",
    ),
)
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q8_ptr,  # [num_tokens, num_heads * head_dim] fp8, written when FP8_OUT
    q8_scale_ptr,  # [num_tokens, num_heads] fp32, written when FP8_OUT
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    FP8_OUT: tl.constexpr,
):
    """Program (q_tile, kv_head, req): query tokens [q_tile * BLOCK_Q, +BLOCK_Q) of request req;
    with FP8_OUT also their output quantized per head (`store_fp8_heads`). Row r is token
    q_tile * BLOCK_Q + r // GROUP and query head kv_head * GROUP + r % GROUP. The token at chunk
    index j sits at position p = seq_len - q_len + j and sees keys 0..p (with WINDOW > 0:
    p - WINDOW + 1..p; the loop starts at the tile's first row's window)."""
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    tok0 = q_tile * BLOCK_Q
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tok0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (tok < q_len)
    q_offs = (q_start + tok).to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(query_ptr + q_offs[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_hi = tl.minimum(seq_len, prefix_len + tok0 + BLOCK_Q)
    kv_first = 0
    if WINDOW > 0:
        kv_first = tl.maximum(prefix_len + tok0 - WINDOW + 1, 0)
    # Tiles start at multiples of BLOCK_N: a row reads the same tiles in every chunk and decode.
    kv_lo = kv_first // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_kv_range(
        acc,
        m_i,
        l_i,
        q,
        prefix_len + tok,
        kv_lo,
        kv_first,
        kv_hi,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + req.to(tl.int64) * stride_bt_req,
        kv_head,
        stride_cache_block,
        stride_cache_slot,
        stride_cache_head,
        qk_scale,
        BLOCK_N,
        BLOCK_SIZE,
        HEAD_DIM,
        DOT_PRECISION,
        WINDOW,
    )
    out = (acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
    o_offs = (q_start + tok).to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + o_offs[:, None] + offs_d[None, :], out, mask=row_valid[:, None])
    if FP8_OUT:
        num_heads = tl.num_programs(1) * GROUP
        store_fp8_heads(
            q8_ptr, q8_scale_ptr, out.to(tl.float32), q_start + tok, head, row_valid, num_heads,
            HEAD_DIM,
        )  # fmt: skip


def _unified_tiles(
    max_query_len: int,
    group: int,
    head_dim: int,
    block_n: int | None,
    block_m: int | None,
    num_warps: int | None,
    num_stages: int | None,
) -> tuple[int, int, int, dict[str, int]]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N, launch options) of the unified kernel; overrides checked."""
    # Rows = tokens x group heads; size the tile to the longest chunk (decodes: 16 rows).
    if block_m is None:
        block_m = min(128, max(16, triton.next_power_of_2(max_query_len * group)))
    elif block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    _check_block_n(block_n)
    # Decode tiles (16 rows) stream K/V fastest with 2 warps: ~3.0 TB/s on the H100 at batch 256
    # and 1024 keys, 1-4% over 4 warps (benchmarks/bench_attention.py).
    launch = {"num_warps": num_warps or (2 if block_m <= 16 else 8 if block_m >= 128 else 4)}
    if num_stages is not None:
        launch["num_stages"] = num_stages
    return block_m, block_q, block_n, launch


def _launch_unified(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    out_fp8: Fp8GroupRows | None,
    window: int,
    block_n: int | None,
    block_m: int | None,
    num_warps: int | None,
    num_stages: int | None,
) -> None:
    """Picks the tiles and launches the kernel over (query tiles, KV heads, requests)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    block_m, block_q, block_n, launch = _unified_tiles(
        max_query_len, group, head_dim, block_n, block_m, num_warps, num_stages
    )
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (triton.cdiv(max_query_len, block_q), num_kv_heads, seq_lens.shape[0])
    _paged_attention_kernel[grid](
        out,
        out if out_fp8 is None else out_fp8.q,
        out if out_fp8 is None else out_fp8.scales,
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        DOT_PRECISION=_dot_precision(query.dtype),
        WINDOW=window,
        FP8_OUT=out_fp8 is not None,
        **launch,
    )


def paged_attention_unified(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    *,
    sliding_window: int | None = None,
    block_n: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out_fp8: Fp8GroupRows | None = None,
) -> torch.Tensor:
    """Single-pass attention for any mix of prompt chunks and decodes; writes and returns `out`
    (and `out_fp8`, when given: out's rows quantized per token-group of 128, one group a head).
    `max_query_len` must be >= every query length (an upper bound is fine, e.g. for CUDA graph
    capture). `sliding_window`: each query sees its last that many positions (None: off). `block_n`
    (the key tile, a power of two >= 16), `block_m` (rows: query tokens x the heads of a KV head,
    a power of two >= 16), `num_warps`, `num_stages` override the launch defaults."""
    _check_attention_args(query, kv_cache, block_tables, query_start_loc, seq_lens, out)
    check_fp8_out(out_fp8, out)
    window = _window_constexpr(sliding_window)
    if max_query_len < 0 or max_query_len > max(query.shape[0], 1):
        raise ValueError(
            f"max_query_len must be in [0, num_tokens={query.shape[0]}], got {max_query_len}"
        )
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_query_len == 0 or query.shape[0] == 0:
        return out
    _launch_unified(
        query,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        max_query_len,
        scale,
        out,
        out_fp8,
        window,
        block_n,
        block_m,
        num_warps,
        num_stages,
    )
    return out


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    workspace: SplitKVWorkspace | None = None,
    sliding_window: int | None = None,
    out_fp8: Fp8GroupRows | None = None,
    *,
    unified_tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Causal paged attention, same contract as `paged_attention_ref`; writes and returns `out` (and
    `out_fp8`, when given: out's [num_tokens, num_heads * 128] rows quantized per token-group of
    128, for an FP8 o_proj; heads of 128 only). Query token j of request i (chunk length
    q_i = query_start_loc[i+1] - query_start_loc[i], context L_i = seq_lens[i]) sits at position
    L_i - q_i + j and attends to positions 0..L_i - q_i + j (`sliding_window` W: only the last W):
    out = softmax(scale * q K^T) V, softmax in fp32. Small decode-only batches over long contexts
    take split-KV (`use_split_kv`, on the context a window leaves), others the unified path;
    `unified_tile` (BLOCK_M, num_warps) fixes the unified path's tile and never splits KV.
    `max_query_len` / `max_seq_len` are upper bounds."""
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else 0
    num_kv_heads = kv_cache.shape[3] if kv_cache.dim() == 5 else 1
    window = _window_constexpr(sliding_window)
    max_context = min(max_seq_len, window) if window else max_seq_len
    fp8_cache = kv_cache.dtype == FP8_KV_DTYPE
    if unified_tile is None and use_split_kv(
        num_reqs, query.shape[0], num_kv_heads, max_query_len, max_context, workspace, fp8_cache
    ):
        assert workspace is not None
        return paged_attention_split_kv(
            query,
            kv_cache,
            block_tables,
            seq_lens,
            max_seq_len,
            scale,
            out,
            workspace,
            sliding_window=sliding_window,
            out_fp8=out_fp8,
        )
    return paged_attention_unified(
        query,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        max_query_len,
        scale,
        out,
        sliding_window=sliding_window,
        block_m=None if unified_tile is None else unified_tile[0],
        num_warps=None if unified_tile is None else unified_tile[1],
        out_fp8=out_fp8,
    )
