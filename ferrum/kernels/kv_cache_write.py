"""Triton KV-cache write: each token's key and value into its slot of the paged cache.

KV cache layout, per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`; slot s lives at
block `s // block_size`, offset `s % block_size`. Negative slots are padding and are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES, KV_CACHE_DTYPES

# The largest finite float8_e4m3fn value: FP8 cache writes saturate to it.
FP8_E4M3_MAX: tl.constexpr = tl.constexpr(448.0)


@triton.jit
def to_cache_dtype(x, cache_dtype: tl.constexpr):
    """`x` in the cache's element type; into FP8 saturated to +-FP8_E4M3_MAX (scale 1.0)."""
    if cache_dtype == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_E4M3_MAX), FP8_E4M3_MAX)
    return x.to(cache_dtype)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    num_kv_heads,
    head_dim,
    block_size,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program t: cache[slot_mapping[t]] = (key[t], value[t]); a negative slot is padding."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    cache_offs = (
        (slot // block_size) * stride_cache_block
        + (slot % block_size) * stride_cache_slot
        + offs_h[:, None] * stride_cache_head
        + offs_d[None, :]
    )
    k_offs = tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :]
    k = tl.load(key_ptr + k_offs, mask=mask)
    tl.store(k_cache_ptr + cache_offs, to_cache_dtype(k, k_cache_ptr.dtype.element_ty), mask=mask)
    v_offs = tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :]
    v = tl.load(value_ptr + v_offs, mask=mask)
    tl.store(v_cache_ptr + cache_offs, to_cache_dtype(v, v_cache_ptr.dtype.element_ty), mask=mask)


def check_cache_args(
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Raises ValueError unless kv_cache is [2, blocks, block_size, num_kv_heads, head_dim] float
    with unit last stride and slot_mapping is contiguous int64 [num_tokens]."""
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim)
        or kv_cache.stride(-1) != 1
        or kv_cache.dtype not in KV_CACHE_DTYPES
    ):
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}] float with "
            f"stride(-1) == 1, got {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    if (
        slot_mapping.shape != (num_tokens,)
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
    ):
        raise ValueError(
            f"slot_mapping must be contiguous int64 of shape [{num_tokens}] (num_tokens), got "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """kv_cache[:, slot_mapping[t]] = (key[t], value[t]) for each token t; slots < 0 are skipped."""
    if key.dim() != 3 or key.stride(-1) != 1 or key.dtype not in FLOAT_DTYPES:
        raise ValueError(
            "key must be [num_tokens, num_kv_heads, head_dim] float with stride(-1) == 1, got "
            f"{tuple(key.shape)} {key.dtype} strides {key.stride()}"
        )
    if value.shape != key.shape or value.dtype != key.dtype or value.stride(-1) != 1:
        raise ValueError(
            f"value must match key ({tuple(key.shape)}, {key.dtype}) with stride(-1) == 1, got "
            f"{tuple(value.shape)} {value.dtype}"
        )
    check_cache_args(kv_cache, slot_mapping, *key.shape)
    for t in (value, kv_cache, slot_mapping):
        if t.device != key.device:
            raise ValueError(f"all tensors must be on {key.device}, got one on {t.device}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        kv_cache.shape[2],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
