"""Triton gated delta rule, prefill: `gated_delta_rule_ref` over packed variable-length sequences,
C = 64 tokens a chunk (WY / UT form of transformers' `torch_chunk_gated_delta_rule`). Per value
head, S the state entering the chunk, G_t the in-chunk cumsum of g, q l2-normalised and scaled:
    N = strict_lower((beta * K) K^T * exp(G_i - G_j));  T = (I + N)^-1   (block doubling, fp32)
    U = T (beta * V);  W = T (beta * exp(G) * K);  V' = U - W S
    O = (exp(G) * Q) S + lower((Q K^T) * exp(G_i - G_j)) V'
    S = exp(G_C) S + (exp(G_C - G) * K)^T V'
Sequence i starts from state_pool[slot_ids[i]] (zeros unless has_initial_state[i]) and writes its
final state back; slot ids are distinct, slot id < 0 is padding (zero output, no state touched)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.gated_delta_rule_common import check_gated_delta_rule_args, prepare_launch
from ferrum.kernels.varlen_args import check_varlen_args

CHUNK_SIZE = 64
_LOG2_CHUNK = 6
_L2NORM_EPS: tl.constexpr = tl.constexpr(1e-6)


@triton.jit
def _unit_lower_inverse(n, CHUNK: tl.constexpr, LOG2_CHUNK: tl.constexpr, PRECISION: tl.constexpr):
    """(I + n)^-1 for a strictly lower triangular [CHUNK, CHUNK] fp32 n, by block doubling: inv
    holds the inverses of the diagonal s-blocks; merging pairs [[A, 0], [B, D]] uses [[A^-1, 0],
    [-D^-1 B A^-1, D^-1]], i.e. inv -= inv @ n_cross @ inv, n_cross the lower-left s-blocks of
    each 2s-block. Each term is an entry of a true inverse (no cancelling series), so the error
    stays that of forward substitution."""
    rows = tl.arange(0, CHUNK)
    inv = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for level in tl.static_range(LOG2_CHUNK):
        size = 1 << level
        cross = (
            (rows[:, None] // (2 * size) == rows[None, :] // (2 * size))
            & ((rows[:, None] // size) % 2 == 1)
            & ((rows[None, :] // size) % 2 == 0)
        )
        n_cross = tl.where(cross, n, 0.0)
        if level == 0:
            inv = inv - n_cross
        else:
            step = tl.dot(n_cross, inv, input_precision=PRECISION)
            inv = inv - tl.dot(inv, step, input_precision=PRECISION)
    return inv


@triton.jit
def _gated_delta_rule_prefill_kernel(
    out_ptr,  # [num_tokens, num_v_heads, v_dim]
    q_ptr,  # [num_tokens, num_k_heads, k_dim]
    k_ptr,  # [num_tokens, num_k_heads, k_dim]
    v_ptr,  # [num_tokens, num_v_heads, v_dim]
    g_ptr,  # [num_tokens, num_v_heads]
    beta_ptr,  # [num_tokens, num_v_heads]
    state_ptr,  # [num_slots, num_v_heads, k_dim, v_dim], read and written at the slot
    cu_seqlens_ptr,  # [num_seqs + 1] int32
    slot_ids_ptr,  # [num_seqs] int32
    has_initial_state_ptr,  # [num_seqs] bool, read when HAS_INITIAL_STATE_FLAGS
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
    CHUNK: tl.constexpr,
    LOG2_CHUNK: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    HAS_INITIAL_STATE_FLAGS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INVERSE_PRECISION: tl.constexpr,
):
    """Program (v_block, v_head, seq): state columns [v_block * BLOCK_V, +BLOCK_V) of the head,
    scanned over the sequence's chunks in order."""
    v_block = tl.program_id(0)
    v_head = tl.program_id(1)
    seq = tl.program_id(2)
    k_head = v_head // GROUP
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    rows = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = offs_k < k_dim
    v_mask = offs_v < v_dim
    if slot < 0:
        for c0 in range(start, end, CHUNK):
            tok = (c0 + rows).to(tl.int64)
            o_offs = tok[:, None] * stride_o_tok + v_head * stride_o_head + offs_v[None, :]
            zeros = tl.zeros([CHUNK, BLOCK_V], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + o_offs, zeros, mask=(tok < end)[:, None] & v_mask[None, :])
        return
    if end == start:
        return

    s_ptrs = (
        state_ptr
        + slot * stride_state_slot
        + v_head * stride_state_head
        + offs_k[:, None] * stride_state_k
        + offs_v[None, :]
    )
    s_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    has_init = True
    if HAS_INITIAL_STATE_FLAGS:
        has_init = tl.load(has_initial_state_ptr + seq) != 0
    if has_init:
        state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    strict = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]

    for c0 in range(start, end, CHUNK):
        tok = (c0 + rows).to(tl.int64)
        t_mask = tok < end
        qk_mask = t_mask[:, None] & k_mask[None, :]
        q = tl.load(
            q_ptr + tok[:, None] * stride_q_tok + k_head * stride_q_head + offs_k[None, :],
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)  # [CHUNK, BLOCK_K]
        k = tl.load(
            k_ptr + tok[:, None] * stride_k_tok + k_head * stride_k_head + offs_k[None, :],
            mask=qk_mask,
            other=0.0,
        ).to(tl.float32)  # [CHUNK, BLOCK_K]
        if USE_QK_L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 1) + _L2NORM_EPS)[:, None]
            k = k * tl.rsqrt(tl.sum(k * k, 1) + _L2NORM_EPS)[:, None]
        q = q * scale
        v = tl.load(
            v_ptr + tok[:, None] * stride_v_tok + v_head * stride_v_head + offs_v[None, :],
            mask=t_mask[:, None] & v_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [CHUNK, BLOCK_V]
        g = tl.load(g_ptr + tok * stride_g_tok + v_head, mask=t_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok * stride_beta_tok + v_head, mask=t_mask, other=0.0)
        beta = beta.to(tl.float32)

        g_cum = tl.cumsum(g, 0)  # [CHUNK]; rows past the sequence add 0
        g_last = tl.sum(tl.where(rows == CHUNK - 1, g_cum, 0.0), 0)
        g_diff = g_cum[:, None] - g_cum[None, :]
        k_beta = k * beta[:, None]
        kk = tl.dot(k_beta, tl.trans(k), input_precision=DOT_PRECISION)
        n = tl.where(strict, kk * tl.exp(tl.where(strict, g_diff, 0.0)), 0.0)
        t_inv = _unit_lower_inverse(n, CHUNK, LOG2_CHUNK, INVERSE_PRECISION)
        u = tl.dot(t_inv, v * beta[:, None], input_precision=DOT_PRECISION)
        w = tl.dot(t_inv, k_beta * tl.exp(g_cum)[:, None], input_precision=DOT_PRECISION)
        v_new = u - tl.dot(w, state, input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_V]

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        attn = tl.where(causal, qk * tl.exp(tl.where(causal, g_diff, 0.0)), 0.0)
        out = tl.dot(q * tl.exp(g_cum)[:, None], state, input_precision=DOT_PRECISION)
        out += tl.dot(attn, v_new, input_precision=DOT_PRECISION)
        tl.store(
            out_ptr + tok[:, None] * stride_o_tok + v_head * stride_o_head + offs_v[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=t_mask[:, None] & v_mask[None, :],
        )
        k_decayed = k * tl.exp(g_last - g_cum)[:, None]
        state = state * tl.exp(g_last)
        state += tl.dot(tl.trans(k_decayed), v_new, input_precision=DOT_PRECISION)

    tl.store(s_ptrs, state.to(state_ptr.dtype.element_ty), mask=s_mask)


def gated_delta_rule_prefill(
    q: torch.Tensor,  # [num_tokens, num_k_heads, k_dim]
    k: torch.Tensor,  # [num_tokens, num_k_heads, k_dim]
    v: torch.Tensor,  # [num_tokens, num_v_heads, v_dim]
    g: torch.Tensor,  # [num_tokens, num_v_heads], log decay (<= 0)
    beta: torch.Tensor,  # [num_tokens, num_v_heads]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32
    state_pool: torch.Tensor,  # [num_slots, num_v_heads, k_dim, v_dim], updated at slot_ids
    slot_ids: torch.Tensor,  # [num_seqs] int32; < 0: padding
    has_initial_state: torch.Tensor | None = None,  # [num_seqs] bool; None: all True
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    out: torch.Tensor | None = None,  # [num_tokens, num_v_heads, v_dim]
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule over packed sequences; returns out, in v's dtype. `scale` defaults
    to k_dim ** -0.5. Any lengths work (length 1 is one decode step), so a mixed batch may run
    entirely here. `block_v` (a power of two >= 16) and `num_warps` override the launch defaults."""
    if out is None:
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    num_seqs = check_varlen_args(cu_seqlens, has_initial_state, v.device)
    check_gated_delta_rule_args(q, k, v, g, beta, state_pool, slot_ids, out, num_seqs)
    grid, args, meta = prepare_launch(
        q, k, v, g, beta, state_pool, out, num_seqs, scale, use_qk_l2norm, block_v, num_warps
    )
    if num_seqs == 0 or v.shape[0] == 0:
        return out
    flags = has_initial_state if has_initial_state is not None else slot_ids
    tensors = (out, q, k, v, g, beta, state_pool, cu_seqlens, slot_ids, flags)
    _gated_delta_rule_prefill_kernel[grid](
        *tensors,
        *args,
        **meta,
        CHUNK=CHUNK_SIZE,
        LOG2_CHUNK=_LOG2_CHUNK,
        HAS_INITIAL_STATE_FLAGS=has_initial_state is not None,
        # fp32 inputs stay IEEE (the exactness reference); half inputs take tf32 matmuls.
        DOT_PRECISION="ieee" if v.dtype == torch.float32 else "tf32",
        # The triangular inverse has entries far from 1: tf32 alone loses them.
        INVERSE_PRECISION="ieee" if v.dtype == torch.float32 else "tf32x3",
    )
    return out
