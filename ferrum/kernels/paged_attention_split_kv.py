"""Split-KV paged attention for decode-only batches over long contexts: each request's context is
cut into `num_splits` equal ranges (whole key tiles), one program each, writing unnormalised
partials to a caller-owned workspace; a second kernel combines them with a log-sum-exp reduce. The
ranges follow each context length on the device, the grid only the batch shape (CUDA graph safe).
Same math as `paged_attention_ref`. Workspace, number of parts, which batches: split_kv_plan.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FP8_KV_DTYPE
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
    store_fp8_heads,
)
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from ferrum.kernels.split_kv_plan import SplitKVWorkspace, default_num_splits

# Warps of a split program over an FP8 cache with heads of up to 128 (else 4): at Qwen3-8B's 32
# requests x 8k keys on the H100, 2 warps read 2.33 TB/s of FP8 keys and values, 4 warps 1.99 (8
# parts, 64-key tiles). Wider heads were not measured.
SPLIT_KV_FP8_NUM_WARPS = 2


@triton.jit
def _split_length(context_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per part: context_len / num_splits rounded up to whole BLOCK_N tiles."""
    return tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _context_start(seq_len, WINDOW: tl.constexpr):
    """First key the decode token (at position seq_len - 1) sees."""
    if WINDOW > 0:
        return tl.maximum(seq_len - WINDOW, 0)
    return seq_len * 0


# Eager steps size the block table to their widest request and pick num_splits per batch:
# neither is specialised, nor the metadata pointers' alignment (see paged_attention.py).
@triton.jit(
    do_not_specialize=("stride_bt_req", "num_splits"),
    do_not_specialize_on_alignment=("block_tables_ptr", "seq_lens_ptr"),
)
def _paged_attention_split_kernel(
    partial_out_ptr,  # [max_num_seqs, num_heads, max_splits, head_dim] fp32
    partial_max_ptr,  # [max_num_seqs, num_heads, max_splits] fp32
    partial_sum_ptr,  # [max_num_seqs, num_heads, max_splits] fp32
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
    num_splits,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (part, kv_head, req) of a decode batch (token i belongs to request i). The context
    is keys [lo, seq_len), lo = _context_start(seq_len, WINDOW). With C = _split_length(seq_len -
    lo, num_splits, BLOCK_N), attends the group's query heads to keys [lo + part * C, min(lo +
    (part + 1) * C, seq_len)); stores acc = sum_k exp2(s_k - m) v_k, m = max_k s_k and l = sum_k
    exp2(s_k - m), s the scores scaled by scale * log2(e). Parts past the context store nothing."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    part = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    context_lo = _context_start(seq_len, WINDOW)
    length = _split_length(seq_len - context_lo, num_splits, BLOCK_N)
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


@triton.jit(
    do_not_specialize=("num_splits",),
    do_not_specialize_on_alignment=("seq_lens_ptr", "q8_scale_ptr"),
)
def _split_kv_reduce_kernel(
    out_ptr,  # [num_reqs, num_heads, head_dim]
    q8_ptr,  # [num_reqs, num_heads * head_dim] fp8, written when FP8_OUT
    q8_scale_ptr,  # [num_reqs, num_heads] fp32, written when FP8_OUT
    partial_out_ptr,  # [max_num_seqs, num_heads, max_splits, head_dim] fp32
    partial_max_ptr,  # [max_num_seqs, num_heads, max_splits] fp32
    partial_sum_ptr,  # [max_num_seqs, num_heads, max_splits] fp32
    seq_lens_ptr,  # [num_reqs] int32
    stride_o_tok,
    stride_o_head,
    stride_po_req,
    stride_po_head,
    stride_po_part,
    stride_pm_req,
    stride_pm_head,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOW: tl.constexpr,
    FP8_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (req, head): out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p, M = max_p m_p,
    over the parts inside the context; with FP8_OUT also out quantized (`store_fp8_heads`)."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - _context_start(seq_len, WINDOW)
    num_parts = tl.cdiv(context_len, _split_length(context_len, num_splits, BLOCK_N))
    pm_base = req.to(tl.int64) * stride_pm_req + head * stride_pm_head
    po_base = req.to(tl.int64) * stride_po_req + head * stride_po_head
    offs_d = tl.arange(0, HEAD_DIM)

    m_max = tl.full([], _NEG_BIG, dtype=tl.float32)
    for p in range(0, num_parts):
        m_max = tl.maximum(m_max, tl.load(partial_max_ptr + pm_base + p))
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    denom = tl.full([], 0.0, dtype=tl.float32)
    for p in range(0, num_parts):
        w = tl.exp2(tl.load(partial_max_ptr + pm_base + p) - m_max)
        denom += w * tl.load(partial_sum_ptr + pm_base + p)
        acc += w * tl.load(partial_out_ptr + po_base + p * stride_po_part + offs_d)
    out = (acc / tl.where(denom > 0.0, denom, 1.0)).to(out_ptr.dtype.element_ty)
    o_offs = req.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
    tl.store(out_ptr + o_offs, out)
    if FP8_OUT:
        one = tl.zeros([1], dtype=tl.int32)
        store_fp8_heads(
            q8_ptr, q8_scale_ptr, out.to(tl.float32)[None, :], req + one, head + one, one == 0,
            tl.num_programs(1), HEAD_DIM,
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
    num_splits: int,
    block_n: int,
    window: int,
    fp8_cache: bool,
) -> None:
    """Launches the split kernel: each part's unnormalised partial results into the workspace."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    ws_out, ws_max, ws_sum = workspace.partial_out, workspace.partial_max, workspace.partial_sum
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_attention_split_kernel[(num_splits, num_kv_heads, seq_lens.shape[0])](
        ws_out,
        ws_max,
        ws_sum,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        ws_out.stride(0),
        ws_out.stride(1),
        ws_out.stride(2),
        ws_max.stride(0),
        ws_max.stride(1),
        num_splits,
        GROUP=group,
        BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        DOT_PRECISION=_dot_precision(query.dtype),
        WINDOW=window,
        num_warps=SPLIT_KV_FP8_NUM_WARPS if fp8_cache and head_dim <= 128 else 4,
        **pdl_launch_args(query.device),
    )


def _reduce_parts(
    out: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    out_fp8: Fp8GroupRows | None,
    workspace: SplitKVWorkspace,
    seq_lens: torch.Tensor,  # [num_reqs] int32
    num_splits: int,
    block_n: int,
    window: int,
    device: torch.device,
) -> None:
    """Launches the log-sum-exp reduce of the workspace's parts into `out` (and `out_fp8`)."""
    ws_out, ws_max, ws_sum = workspace.partial_out, workspace.partial_max, workspace.partial_sum
    head_dim = out.shape[2]
    _split_kv_reduce_kernel[(seq_lens.shape[0], out.shape[1])](
        out,
        out if out_fp8 is None else out_fp8.q,
        out if out_fp8 is None else out_fp8.scales,
        ws_out,
        ws_max,
        ws_sum,
        seq_lens,
        out.stride(0),
        out.stride(1),
        ws_out.stride(0),
        ws_out.stride(1),
        ws_out.stride(2),
        ws_max.stride(0),
        ws_max.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        WINDOW=window,
        FP8_OUT=out_fp8 is not None,
        num_warps=1 if head_dim <= 64 else 2,
        **pdl_launch_args(device),
    )


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
) -> torch.Tensor:
    """Split-KV decode attention (token i is request i's only query token); writes `out` (and
    `out_fp8`, when given: out's rows quantized per token-group of 128, one group a head).
    `max_seq_len` must be >= every seq_len (an upper bound is fine). With `sliding_window` W the
    parts split only the last W keys. `num_splits` (default: `default_num_splits`) and `block_n`
    (the key tile, a power of two >= 16) are for tests and tuning."""
    _check_attention_args(query, kv_cache, block_tables, None, seq_lens, out)
    check_fp8_out(out_fp8, out)
    window = _window_constexpr(sliding_window)
    _check_split_batch(query, seq_lens, max_seq_len, workspace)
    num_reqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    fp8_cache = kv_cache.dtype == FP8_KV_DTYPE
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
    _attend_parts(
        query,
        kv_cache,
        block_tables,
        seq_lens,
        scale,
        workspace,
        num_splits,
        block_n,
        window,
        fp8_cache,
    )
    _reduce_parts(out, out_fp8, workspace, seq_lens, num_splits, block_n, window, query.device)
    return out
