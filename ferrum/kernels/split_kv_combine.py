"""The log-sum-exp combine of split-KV decode attention's parts (paged_attention_split_kv.py): for
each of a request's query heads, out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p over the
parts inside its context, M = max_p m_p, parts summed in order 0..num_parts-1 (deterministic).

Two ways to run it, the same arithmetic (bit for bit):
  separate  a second kernel, one program per (request, query head) (`reduce_parts`);
  fused     inside the split kernel: each part's program counts its arrival on its (request,
            kv head)'s counter (`arrival_counters.py`) and the last to arrive combines the
            group's heads and resets the counter (`combine_if_last`): one launch fewer a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.fp8_quant import Fp8GroupRows
from ferrum.kernels.paged_attention_common import _NEG_BIG, store_fp8_heads
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from ferrum.kernels.split_k_sum import last_to_arrive
from ferrum.kernels.split_kv_plan import SplitKVWorkspace


@triton.jit
def split_length(context_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per part: context_len / num_splits rounded up to whole BLOCK_N tiles."""
    return tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def context_start(seq_len, WINDOW: tl.constexpr):
    """First key the decode token (at position seq_len - 1) sees."""
    if WINDOW > 0:
        return tl.maximum(seq_len - WINDOW, 0)
    return seq_len * 0


@triton.jit
def combine_parts(
    out_ptr, q8_ptr, q8_scale_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    req, head, row_valid, num_parts, num_heads,
    stride_o_tok, stride_o_head, stride_po_req, stride_po_head, stride_po_part,
    stride_pm_req, stride_pm_head,
    HEAD_DIM: tl.constexpr, FP8_OUT: tl.constexpr,
):  # fmt: skip
    """Combines request `req`'s parts for the query heads `head` [R] (rows where `row_valid`)
    into out (and its FP8 rows). Partials are read through L2 (.cg): other SMs wrote them."""
    offs_d = tl.arange(0, HEAD_DIM)
    pm_base = req.to(tl.int64) * stride_pm_req + head * stride_pm_head
    po_base = req.to(tl.int64) * stride_po_req + head * stride_po_head
    m_max = tl.full(head.shape, _NEG_BIG, dtype=tl.float32)
    for p in range(0, num_parts):
        part_max = tl.load(partial_max_ptr + pm_base + p, mask=row_valid, other=_NEG_BIG,
                           cache_modifier=".cg")  # fmt: skip
        m_max = tl.maximum(m_max, part_max)
    acc = tl.zeros([head.shape[0], HEAD_DIM], dtype=tl.float32)
    denom = tl.zeros(head.shape, dtype=tl.float32)
    for p in range(0, num_parts):
        part_max = tl.load(partial_max_ptr + pm_base + p, mask=row_valid, other=_NEG_BIG,
                           cache_modifier=".cg")  # fmt: skip
        w = tl.exp2(part_max - m_max)
        part_sum = tl.load(partial_sum_ptr + pm_base + p, mask=row_valid, other=0.0,
                           cache_modifier=".cg")  # fmt: skip
        denom += w * part_sum
        po_offs = po_base + p * stride_po_part
        part_out = tl.load(partial_out_ptr + po_offs[:, None] + offs_d[None, :],
                           mask=row_valid[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        acc += w[:, None] * part_out
    out = (acc / tl.where(denom > 0.0, denom, 1.0)[:, None]).to(out_ptr.dtype.element_ty)
    o_offs = req.to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + o_offs[:, None] + offs_d[None, :], out, mask=row_valid[:, None])
    if FP8_OUT:
        store_fp8_heads(
            q8_ptr, q8_scale_ptr, out.to(tl.float32), req + head * 0, head, row_valid,
            num_heads, HEAD_DIM,
        )  # fmt: skip


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
    stride_o_tok, stride_o_head, stride_po_req, stride_po_head, stride_po_part,
    stride_pm_req, stride_pm_head,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, FP8_OUT: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (req, head): `combine_parts` for one query head."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    req = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - context_start(seq_len, WINDOW)
    num_parts = tl.cdiv(context_len, split_length(context_len, num_splits, BLOCK_N))
    head = tl.program_id(1) + tl.arange(0, 1)
    combine_parts(
        out_ptr, q8_ptr, q8_scale_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
        req, head, head >= 0, num_parts, tl.num_programs(1),
        stride_o_tok, stride_o_head, stride_po_req, stride_po_head, stride_po_part,
        stride_pm_req, stride_pm_head, HEAD_DIM, FP8_OUT,
    )  # fmt: skip


@triton.jit
def combine_if_last(
    counter, out_ptr, q8_ptr, q8_scale_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
    req, head, row_valid, num_parts, num_heads,
    stride_o_tok, stride_o_head, stride_po_req, stride_po_head, stride_po_part,
    stride_pm_req, stride_pm_head,
    HEAD_DIM: tl.constexpr, FP8_OUT: tl.constexpr,
):  # fmt: skip
    """Called by each part's program after it stored its partials: counts it on the (request,
    kv head)'s `counter`; the last of the num_parts to arrive combines the group and resets it."""
    if last_to_arrive(counter, num_parts):
        combine_parts(
            out_ptr, q8_ptr, q8_scale_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
            req, head, row_valid, num_parts, num_heads,
            stride_o_tok, stride_o_head, stride_po_req, stride_po_head, stride_po_part,
            stride_pm_req, stride_pm_head, HEAD_DIM, FP8_OUT,
        )  # fmt: skip
        tl.store(counter, 0)


def reduce_parts(
    out: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    out_fp8: Fp8GroupRows | None,
    workspace: SplitKVWorkspace,
    seq_lens: torch.Tensor,  # [num_reqs] int32
    num_splits: int,
    block_n: int,
    window: int,
) -> None:
    """Launches the separate combine of the workspace's parts into `out` (and `out_fp8`)."""
    ws_out, ws_max, ws_sum = workspace.partial_out, workspace.partial_max, workspace.partial_sum
    _split_kv_reduce_kernel[(seq_lens.shape[0], out.shape[1])](
        out,
        out if out_fp8 is None else out_fp8.q,
        out if out_fp8 is None else out_fp8.scales,
        ws_out, ws_max, ws_sum, seq_lens,
        out.stride(0), out.stride(1), ws_out.stride(0), ws_out.stride(1), ws_out.stride(2),
        ws_max.stride(0), ws_max.stride(1),
        num_splits,
        HEAD_DIM=out.shape[2],
        BLOCK_N=block_n,
        WINDOW=window,
        FP8_OUT=out_fp8 is not None,
        num_warps=1 if out.shape[2] <= 64 else 2,
        **pdl_launch_args(out.device),
    )  # fmt: skip
