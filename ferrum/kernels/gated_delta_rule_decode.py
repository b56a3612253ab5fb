"""Triton gated delta rule, decode: one recurrent step per request and value head h, the state
S = state_pool[slot_ids[i], h] updated in place, or written to dst_slot_ids[i] when given (fp32;
`gated_delta_rule_decode_ref`):
    q, k = l2norm(q), l2norm(k) (use_qk_l2norm);  S = exp(g) * S;  S += k (beta * (v - S^T k))^T
    o = S^T (scale * q)        (value head h reads q/k head h // (num_v_heads // num_k_heads))
Slot id < 0 is padding (CUDA graph buckets): zero output, no state touched; live slot ids differ."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.gated_delta_rule_common import check_gated_delta_rule_args, prepare_launch

_L2NORM_EPS: tl.constexpr = tl.constexpr(1e-6)


@triton.jit
def _gated_delta_rule_decode_kernel(
    out_ptr,  # [num_reqs, num_v_heads, v_dim]
    q_ptr,  # [num_reqs, num_k_heads, k_dim]
    k_ptr,  # [num_reqs, num_k_heads, k_dim]
    v_ptr,  # [num_reqs, num_v_heads, v_dim]
    g_ptr,  # [num_reqs, num_v_heads]
    beta_ptr,  # [num_reqs, num_v_heads]
    state_ptr,  # [num_slots, num_v_heads, k_dim, v_dim], read at the slot, written at the dst
    slot_ids_ptr,  # [num_reqs] int32
    dst_slot_ids_ptr,  # [num_reqs] int32 (read with HAS_DST only)
    scale,
    k_dim,
    v_dim,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    stride_g_tok,
    stride_beta_tok,
    stride_state_slot,
    stride_state_head,
    stride_state_k,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    HAS_DST: tl.constexpr,
):
    """Program (v_block, v_head, req): state columns [v_block * BLOCK_V, +BLOCK_V) of the head."""
    v_block = tl.program_id(0)
    v_head = tl.program_id(1)
    req = tl.program_id(2).to(tl.int64)
    k_head = v_head // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < k_dim
    v_mask = offs_v < v_dim
    o_ptrs = out_ptr + req * stride_o_tok + v_head * stride_o_head + offs_v
    slot = tl.load(slot_ids_ptr + req).to(tl.int64)
    if slot < 0:
        tl.store(o_ptrs, tl.zeros([BLOCK_V], dtype=out_ptr.dtype.element_ty), mask=v_mask)
        return

    q_ptrs = q_ptr + req * stride_q_tok + k_head * stride_q_head + offs_k
    k_ptrs = k_ptr + req * stride_k_tok + k_head * stride_k_head + offs_k
    q = tl.load(q_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    if USE_QK_L2NORM:
        q = q * tl.rsqrt(tl.sum(q * q, 0) + _L2NORM_EPS)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + _L2NORM_EPS)
    q = q * scale
    v = tl.load(
        v_ptr + req * stride_v_tok + v_head * stride_v_head + offs_v, mask=v_mask, other=0.0
    )
    g = tl.load(g_ptr + req * stride_g_tok + v_head).to(tl.float32)
    beta = tl.load(beta_ptr + req * stride_beta_tok + v_head).to(tl.float32)

    s_ptrs = (
        state_ptr
        + slot * stride_state_slot
        + v_head * stride_state_head
        + offs_k[:, None] * stride_state_k
        + offs_v[None, :]
    )
    s_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32) * tl.exp(g)  # [BLOCK_K, BLOCK_V]
    kv_mem = tl.sum(state * k[:, None], 0)
    delta = (v.to(tl.float32) - kv_mem) * beta
    state = state + k[:, None] * delta[None, :]
    out = tl.sum(state * q[:, None], 0)
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=v_mask)
    if HAS_DST:
        dst = tl.load(dst_slot_ids_ptr + req).to(tl.int64)
        s_ptrs += (dst - slot) * stride_state_slot
    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)


def gated_delta_rule_decode(
    q: torch.Tensor,  # [num_reqs, num_k_heads, k_dim]
    k: torch.Tensor,  # [num_reqs, num_k_heads, k_dim]
    v: torch.Tensor,  # [num_reqs, num_v_heads, v_dim]
    g: torch.Tensor,  # [num_reqs, num_v_heads], log decay (<= 0)
    beta: torch.Tensor,  # [num_reqs, num_v_heads]
    state_pool: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim], updated at slot_ids
    slot_ids: torch.Tensor,  # [num_reqs] int32; < 0: padding
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    out: torch.Tensor | None = None,  # [num_reqs, num_v_heads, v_dim]
    block_v: int | None = None,
    num_warps: int | None = None,
    dst_slot_ids: torch.Tensor | None = None,  # [num_reqs] int32; None: slot_ids
) -> torch.Tensor:
    """One gated-delta-rule step per request (token i is request i's); returns out, in v's
    dtype. `scale` defaults to k_dim ** -0.5; `block_v` (a power of two >= 16) and `num_warps`
    override the launch defaults (tuning). With `dst_slot_ids` the new state of a live request
    goes to dst_slot_ids[i] (its slot keeps the old one); the dst slots must be distinct from
    every live request's slot but its own."""
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    num_reqs = v.shape[0] if v.dim() == 3 else 0
    check_gated_delta_rule_args(q, k, v, g, beta, state_pool, slot_ids, out, num_reqs)
    if dst_slot_ids is not None:
        check_gated_delta_rule_args(q, k, v, g, beta, state_pool, dst_slot_ids, out, num_reqs)
    grid, args, meta = prepare_launch(
        q, k, v, g, beta, state_pool, out, num_reqs, scale, use_qk_l2norm, block_v, num_warps
    )
    if num_reqs:
        dst = slot_ids if dst_slot_ids is None else dst_slot_ids
        _gated_delta_rule_decode_kernel[grid](
            out, q, k, v, g, beta, state_pool, slot_ids, dst, *args, **meta,
            HAS_DST=dst_slot_ids is not None,
        )  # fmt: skip
    return out
