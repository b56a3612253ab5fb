"""Split-KV paged attention for decode-only batches over long contexts: each request's context is
cut into `num_splits` equal ranges (whole key tiles), one program each, writing unnormalised
partials to a caller-owned workspace, combined with a log-sum-exp reduce (split_kv_combine.py:
by a second kernel, or fused, by the last of a request's parts to finish). The ranges follow each
context length on the device, the grid only the batch shape (CUDA graph safe). Same math as
`paged_attention_ref`. Workspace, number of parts, which batches: split_kv_plan.py."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ferrum import envs
from ferrum.kernels import FP8_KV_DTYPE
from ferrum.kernels.arrival_counters import arrival_counters
from ferrum.kernels.fp8_quant import Fp8GroupRows
from ferrum.kernels.paged_attention_common import (
    _LOG2E,
    _NEG_BIG,
    _attend_kv_range,
    _check_attention_args,
    _check_block_n,
    _dot_precision,
    _window_constexpr,
    check_fp8_out,
)
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from ferrum.kernels.split_kv_combine import (
    combine_if_last,
    context_start,
    reduce_parts,
    split_length,
)
from ferrum.kernels.split_kv_plan import SplitKVWorkspace, default_num_splits

# Warps of a split program over an FP8 cache with heads of up to 128 (else 4): at Qwen3-8B's 32
# requests x 8k keys on the H100, 2 warps read 2.33 TB/s of FP8 keys and values, 4 warps 1.99 (8
# parts, 64-key tiles). Wider heads were not measured.
SPLIT_KV_FP8_NUM_WARPS = 2


# Eager steps size the block table to their widest request and pick num_splits per batch:
# neither is specialised, nor the metadata pointers' alignment (see paged_attention.py).
@triton.jit(
    do_not_specialize=("stride_bt_req", "num_splits"),
    do_not_specialize_on_alignment=(
        "block_tables_ptr", "seq_lens_ptr", "counters_ptr", "q8_scale_ptr",
    ),
)  # fmt: skip
def _paged_attention_split_kernel(
    partial_out_ptr,  # [max_num_seqs, num_heads, max_splits, head_dim] fp32
    partial_max_ptr,  # [max_num_seqs, num_heads, max_splits] fp32
    partial_sum_ptr,  # [max_num_seqs, num_heads, max_splits] fp32
    out_ptr,  # [num_reqs, num_heads, head_dim], written when FUSED_REDUCE
    q8_ptr,  # [num_reqs, num_heads * head_dim] fp8, written when FUSED_REDUCE and FP8_OUT
    q8_scale_ptr,  # [num_reqs, num_heads] fp32, likewise
    counters_ptr,  # [>= num_reqs * num_kv_heads] int32, zero between launches (FUSED_REDUCE)
    query_ptr,  # [num_reqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    stride_po_req,
    stride_po_head,
    stride_po_part,
    stride_pm_req,
    stride_pm_head,
    stride_o_tok,
    stride_o_head,
    num_splits,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    FP8_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (part, kv_head, req) of a decode batch (token i belongs to request i). The context
    is keys [lo, seq_len), lo = context_start(seq_len, WINDOW). With C = split_length(seq_len -
    lo, num_splits, BLOCK_N), attends the group's query heads to keys [lo + part * C, min(lo +
    (part + 1) * C, seq_len)); stores acc = sum_k exp2(s_k - m) v_k, m = max_k s_k and l = sum_k
    exp2(s_k - m), s the scores scaled by scale * log2(e). Parts past the context store nothing.
    FUSED_REDUCE: the last of the request's parts to finish combines the group's heads."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    part = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    context_lo = context_start(seq_len, WINDOW)
    length = split_length(seq_len - context_lo, num_splits, BLOCK_N)
    kv_lo = context_lo + part * length
    if kv_lo >= seq_len:
        return
    kv_hi = tl.minimum(seq_len, kv_lo + length)

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    q_offs = req.to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(query_ptr + q_offs[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_kv_range(
        acc,
        m_i,
        l_i,
        q,
        tl.full([BLOCK_M], 0, dtype=tl.int32) + seq_len - 1,
        kv_lo,
        kv_lo,
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
    po_offs = req.to(tl.int64) * stride_po_req + head * stride_po_head + part * stride_po_part
    tl.store(partial_out_ptr + po_offs[:, None] + offs_d[None, :], acc, mask=row_valid[:, None])
    pm_offs = req.to(tl.int64) * stride_pm_req + head * stride_pm_head + part
    tl.store(partial_max_ptr + pm_offs, m_i, mask=row_valid)
    tl.store(partial_sum_ptr + pm_offs, l_i, mask=row_valid)
    if FUSED_REDUCE:
        combine_if_last(
            counters_ptr + req * tl.num_programs(1) + kv_head, out_ptr, q8_ptr, q8_scale_ptr,
            partial_out_ptr, partial_max_ptr, partial_sum_ptr, req, head, row_valid,
            tl.cdiv(seq_len - context_lo, length), tl.num_programs(1) * GROUP,
            stride_o_tok, stride_o_head, stride_po_req, stride_po_head, stride_po_part,
            stride_pm_req, stride_pm_head, HEAD_DIM, FP8_OUT,
        )  # fmt: skip


def _check_split_batch(
    query: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, workspace: SplitKVWorkspace
) -> None:
    num_reqs = seq_lens.shape[0]
    if query.shape[0] != num_reqs:
        raise ValueError(
            f"query must hold one token per request for split-KV: num_tokens {query.shape[0]} "
            f"!= num_reqs {num_reqs}"
        )
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if num_reqs > workspace.max_num_seqs:
        raise ValueError(
            f"num_reqs {num_reqs} exceeds workspace max_num_seqs {workspace.max_num_seqs}"
        )


def _check_workspace(
    workspace: SplitKVWorkspace, num_heads: int, head_dim: int, device: torch.device
) -> None:
    ws_out, ws_max, ws_sum = workspace.partial_out, workspace.partial_max, workspace.partial_sum
    if (
        ws_out.shape[1] != num_heads
        or ws_out.shape[3] != head_dim
        or ws_out.stride(3) != 1
        or ws_max.shape != ws_out.shape[:3]
        or ws_sum.stride() != ws_max.stride()
        or ws_max.stride(2) != 1
        or any(t.dtype != torch.float32 for t in (ws_out, ws_max, ws_sum))
        or any(t.device != device for t in (ws_out, ws_max, ws_sum))
    ):
        raise ValueError(
            "workspace must come from allocate_split_kv_workspace for num_heads="
            f"{num_heads}, head_dim={head_dim} on {device}"
        )


def _attend_parts(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    workspace: SplitKVWorkspace,
    plan: tuple[int, int, int],  # (num_splits, block_n, window)
    out: torch.Tensor,
    out_fp8: Fp8GroupRows | None,
    fused_reduce: bool,
) -> None:
    """Launches the split kernel: each part's unnormalised partial results into the workspace,
    and with `fused_reduce` the last part of each request's kv head combines them into out."""
    num_splits, block_n, window = plan
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    ws_out, ws_max, ws_sum = workspace.partial_out, workspace.partial_max, workspace.partial_sum
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    fp8_cache = kv_cache.dtype == FP8_KV_DTYPE
    counters = (
        arrival_counters(query.device, num_reqs * num_kv_heads, "split-KV attention")
        if fused_reduce
        else seq_lens
    )
    fp8_rows = out_fp8 is not None and fused_reduce
    _paged_attention_split_kernel[(num_splits, num_kv_heads, num_reqs)](
        ws_out, ws_max, ws_sum, out,
        out_fp8.q if fp8_rows else out, out_fp8.scales if fp8_rows else out, counters,
        query, k_cache, v_cache, block_tables, seq_lens,
        scale * _LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        ws_out.stride(0), ws_out.stride(1), ws_out.stride(2),
        ws_max.stride(0), ws_max.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        DOT_PRECISION=_dot_precision(query.dtype),
        WINDOW=window,
        FUSED_REDUCE=fused_reduce,
        FP8_OUT=fp8_rows,
        num_warps=SPLIT_KV_FP8_NUM_WARPS if fp8_cache and head_dim <= 128 else 4,
        **pdl_launch_args(query.device),
    )  # fmt: skip


@functools.cache
def _fused_reduce_by_default() -> bool:
    """Read once: a decode step calls the path once a layer."""
    return envs.debug_split_kv_fused_reduce()


def paged_attention_split_kv(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim], one decode token per request
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    workspace: SplitKVWorkspace,
    num_splits: int | None = None,
    block_n: int | None = None,
    sliding_window: int | None = None,
    out_fp8: Fp8GroupRows | None = None,
    fused_reduce: bool | None = None,
) -> torch.Tensor:
    """Split-KV decode attention (token i is request i's only query token); writes `out` (and
    `out_fp8`, when given: out's rows quantized per token-group of 128, one group a head).
    `max_seq_len` must be >= every seq_len (an upper bound is fine). With `sliding_window` W the
    parts split only the last W keys. `num_splits` (default: `default_num_splits`) and `block_n`
    (the key tile, a power of two >= 16) are for tests and tuning; so is `fused_reduce` (the
    combine inside the split kernel, split_kv_combine.py; default: the separate kernel unless
    FERRUM_DEBUG_SPLIT_KV_FUSED_REDUCE=1, until the fused one is measured on a GPU)."""
    _check_attention_args(query, kv_cache, block_tables, None, seq_lens, out)
    check_fp8_out(out_fp8, out)
    window = _window_constexpr(sliding_window)
    _check_split_batch(query, seq_lens, max_seq_len, workspace)
    num_reqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    fp8_cache = kv_cache.dtype == FP8_KV_DTYPE
    if fused_reduce is None:
        fused_reduce = _fused_reduce_by_default()
    if num_splits is None:
        num_splits = default_num_splits(
            num_reqs, kv_cache.shape[3], workspace.max_splits, fp8_cache
        )
    if not 1 <= num_splits <= workspace.max_splits:
        raise ValueError(
            f"num_splits must be in [1, workspace max_splits={workspace.max_splits}], "
            f"got {num_splits}"
        )
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    _check_block_n(block_n)
    _check_workspace(workspace, num_heads, head_dim, query.device)
    if num_reqs == 0:
        return out
    plan = (num_splits, block_n, window)
    _attend_parts(
        query, kv_cache, block_tables, seq_lens, scale, workspace, plan, out, out_fp8, fused_reduce
    )
    if not fused_reduce:
        reduce_parts(out, out_fp8, workspace, seq_lens, *plan)
    return out
