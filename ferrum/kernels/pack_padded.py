"""Triton copy of one request's q, k and v rows into SDPA's padded token-major buffer
(`sdpa_prefill.pack_padded`, whose torch copies are the reference): one launch instead of three
strided copies and a fill."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_PACK_ROWS = 32


def pack_padded_rows(
    packed: torch.Tensor,  # [padded, heads + 2 * kv_heads, head_dim], contiguous
    query: torch.Tensor,  # [length, heads, head_dim]
    key: torch.Tensor,  # [length, kv_heads, head_dim]
    value: torch.Tensor,  # [length, kv_heads, head_dim]
) -> None:
    """packed[:length] = [q | k | v] row by row; packed[length:] = 0."""
    length, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    padded = packed.shape[0]
    _pack_padded_kernel[(triton.cdiv(padded, _PACK_ROWS), heads + 2 * kv_heads)](
        packed,
        query,
        key,
        value,
        length,
        padded,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        packed.stride(0),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=_PACK_ROWS,
    )


# The lengths follow the prompts, and the strides the projections' layout (the warm-up packs
# contiguous tensors): none is specialised, so serving compiles no variant the warm-up did not.
@triton.jit(
    do_not_specialize=(
        "length",
        "padded",
        "stride_q_tok",
        "stride_q_head",
        "stride_k_tok",
        "stride_k_head",
        "stride_v_tok",
        "stride_v_head",
        "stride_packed_tok",
    )
)
def _pack_padded_kernel(
    packed_ptr,  # [padded, HEADS + 2 * KV_HEADS, HEAD_DIM], token-major
    q_ptr,  # [length, HEADS, HEAD_DIM]
    k_ptr,  # [length, KV_HEADS, HEAD_DIM]
    v_ptr,  # [length, KV_HEADS, HEAD_DIM]
    length,
    padded,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_packed_tok,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program (t, h): rows [t * BLOCK_T, +BLOCK_T) of packed head h (q heads, then k, then v)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    if head < HEADS:
        src = q_ptr + rows[:, None].to(tl.int64) * stride_q_tok + head * stride_q_head
    elif head < HEADS + KV_HEADS:
        src = k_ptr + rows[:, None].to(tl.int64) * stride_k_tok + (head - HEADS) * stride_k_head
    else:
        src = (
            v_ptr
            + rows[:, None].to(tl.int64) * stride_v_tok
            + (head - HEADS - KV_HEADS) * stride_v_head
        )
    in_dims = dims[None, :] < HEAD_DIM
    x = tl.load(src + dims[None, :], mask=(rows[:, None] < length) & in_dims, other=0.0)
    dst = (
        packed_ptr
        + rows[:, None].to(tl.int64) * stride_packed_tok
        + head * HEAD_DIM
        + dims[None, :]
    )
    tl.store(dst, x, mask=(rows[:, None] < padded) & in_dims)
