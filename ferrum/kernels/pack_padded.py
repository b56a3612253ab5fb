"""Triton copies of one request's rows into SDPA's padded token-major buffer: its q, k and v
rows (`sdpa_prefill.pack_padded`), or its chunk's q rows after a cached prefix and its whole
context's keys and values from the paged cache (`sdpa_prefill.pack_padded_from_cache`); the torch
code there is the reference. One launch instead of strided copies, gathers and a fill."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_PACK_ROWS = 32


def _layout(heads: int, kv_heads: int, head_dim: int) -> dict[str, int]:
    """The packed buffer's layout constants both kernels take, and their tile."""
    return dict(
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=_PACK_ROWS,
    )


@triton.jit
def _store_packed_rows(
    packed_ptr,
    x,  # [BLOCK_T, BLOCK_D], zero where a row has no value
    rows,  # [BLOCK_T]
    head,
    padded,
    stride_packed_tok,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """packed[rows, head, :HEAD_DIM] = x, for the rows below `padded`."""
    dims = tl.arange(0, BLOCK_D)
    dst = (
        packed_ptr
        + rows[:, None].to(tl.int64) * stride_packed_tok
        + head * HEAD_DIM
        + dims[None, :]
    )
    tl.store(dst, x, mask=(rows[:, None] < padded) & (dims[None, :] < HEAD_DIM))


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
        **_layout(heads, kv_heads, head_dim),
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
    _store_packed_rows(packed_ptr, x, rows, head, padded, stride_packed_tok, HEAD_DIM, BLOCK_D)


def pack_padded_rows_from_cache(
    packed: torch.Tensor,  # [padded, heads + 2 * kv_heads, head_dim], contiguous
    query: torch.Tensor,  # [chunk, heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32
    prefix: int,
) -> None:
    """packed[prefix:prefix + chunk, :heads] = query, packed[:prefix + chunk, heads:] = the
    context's keys and values from the cache; every other element 0."""
    chunk, heads, head_dim = query.shape
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    padded = packed.shape[0]
    _pack_from_cache_kernel[(triton.cdiv(padded, _PACK_ROWS), heads + 2 * kv_heads)](
        packed,
        query,
        kv_cache,
        block_table,
        prefix,
        prefix + chunk,
        padded,
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        packed.stride(0),
        BLOCK_SIZE=block_size,
        **_layout(heads, kv_heads, head_dim),
    )


# As above, no integer that follows the request is specialised (cache strides are fixed at
# start-up). Query rows start 16-byte aligned every step (heads x head_dim elements, head_dim a
# multiple of 8); a table row starts anywhere in the step's table: alignment not specialised.
@triton.jit(
    do_not_specialize=(
        "prefix",
        "seq_len",
        "padded",
        "stride_q_tok",
        "stride_q_head",
        "stride_packed_tok",
    ),
    do_not_specialize_on_alignment=("table_ptr",),
)
def _pack_from_cache_kernel(
    packed_ptr,  # [padded, HEADS + 2 * KV_HEADS, HEAD_DIM], token-major
    q_ptr,  # [seq_len - prefix, HEADS, HEAD_DIM]
    cache_ptr,  # [2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM]
    table_ptr,  # [max_blocks] int32
    prefix,
    seq_len,
    padded,
    stride_q_tok,
    stride_q_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_packed_tok,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Program (t, h): rows [t * BLOCK_T, +BLOCK_T) of packed head h (q heads, then k, then v)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    in_dims = dims[None, :] < HEAD_DIM
    if head < HEADS:
        in_chunk = (rows >= prefix) & (rows < seq_len)
        src = q_ptr + (rows - prefix)[:, None].to(tl.int64) * stride_q_tok + head * stride_q_head
        x = tl.load(src + dims[None, :], mask=in_chunk[:, None] & in_dims, other=0.0)
    else:
        kv = (head - HEADS) // KV_HEADS  # 0: keys, 1: values
        kv_head = (head - HEADS) % KV_HEADS
        in_context = rows < seq_len
        block = tl.load(table_ptr + rows // BLOCK_SIZE, mask=in_context, other=0)
        src = (
            cache_ptr
            + kv * stride_cache_kv
            + block[:, None].to(tl.int64) * stride_cache_block
            + (rows % BLOCK_SIZE)[:, None] * stride_cache_slot
            + kv_head * stride_cache_head
        )
        x = tl.load(src + dims[None, :], mask=in_context[:, None] & in_dims, other=0.0)
    _store_packed_rows(packed_ptr, x, rows, head, padded, stride_packed_tok, HEAD_DIM, BLOCK_D)
