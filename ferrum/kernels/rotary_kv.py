"""Triton neox-style RoPE on q and k, with the optional Qwen3 per-head q/k RMSNorm, fused with the
write of k and v into the paged KV cache. Per token t with table row r (positions[t], or t without
positions), per head x = [x1 | x2] (halves of head_dim = rotary_dim):
  x  <- weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)     (only when a norm weight is given)
  x  <- [x1 cos[r] - x2 sin[r] | x2 cos[r] + x1 sin[r]]     (fp32, rounded once)
q and k are rotated in place; then kv_cache[:, slot_mapping[t]] = (k[t], v[t]) unless the slot is
negative (padding). KV cache layout: `[2, num_blocks, block_size, num_kv_heads, head_dim]`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES
from ferrum.kernels.kv_cache_write import check_cache_args, to_cache_dtype
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

MAX_HEAD_DIM = 512
# Query heads a program rotates (the key heads and the cache write take one more program).
Q_HEADS_PER_PROGRAM = 8


@triton.jit
def _norm_rope_heads(
    x_ptr,  # [num_heads, head_dim] of one token
    w_ptr,  # [head_dim] norm weight
    stride_head,
    num_heads,
    cos,  # [HALF_PAD] fp32
    sin,  # [HALF_PAD] fp32
    eps,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """Returns (rotated first halves, rotated second halves, their pointers, mask), fp32."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    ptrs = x_ptr + offs_h[:, None] * stride_head + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        dtype = x_ptr.dtype.element_ty
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * inv_rms[:, None]).to(dtype).to(tl.float32) * w1[None, :]).to(dtype)
        x2 = ((x2 * inv_rms[:, None]).to(dtype).to(tl.float32) * w2[None, :]).to(dtype)
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    return y1, y2, ptrs, mask


@triton.jit
def _rotary_kv_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens] int64, read when HAS_POSITIONS
    slot_mapping_ptr,  # [num_tokens] int64
    cos_ptr,  # [num_rows, head_dim // 2] fp32
    sin_ptr,  # [num_rows, head_dim // 2] fp32
    q_norm_ptr,  # [head_dim]
    k_norm_ptr,  # [head_dim]
    num_heads,
    num_kv_heads,
    block_size,
    eps,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_cos,
    stride_sin,
    HALF: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, p) for p < P = cdiv(num_heads, BLOCK_HQ): rotate q[t]'s heads
    [p * BLOCK_HQ, min((p + 1) * BLOCK_HQ, num_heads)) in place. Program (t, P): rotate k[t] in place, then write
    k[t] and v[t] to the cache slot. (Several programs a token split a one-token decode step's
    serial work.)"""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    if HAS_POSITIONS:
        row = tl.load(positions_ptr + tok)
    else:
        row = tok
    offs_d = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + row * stride_cos + offs_d, mask=offs_d < HALF, other=0.0)
    sin = tl.load(sin_ptr + row * stride_sin + offs_d, mask=offs_d < HALF, other=0.0)

    first_head = tl.program_id(1) * BLOCK_HQ
    if first_head < num_heads:
        q1, q2, q_ptrs, q_mask = _norm_rope_heads(
            query_ptr + tok * stride_q_tok + first_head * stride_q_head,
            q_norm_ptr,
            stride_q_head,
            num_heads - first_head,
            cos,
            sin,
            eps,
            HALF,
            HAS_NORM,
            BLOCK_HQ,
            HALF_PAD,
        )
        tl.store(q_ptrs, q1.to(query_ptr.dtype.element_ty), mask=q_mask)
        tl.store(q_ptrs + HALF, q2.to(query_ptr.dtype.element_ty), mask=q_mask)
    else:
        k1, k2, k_ptrs, k_mask = _norm_rope_heads(
            key_ptr + tok * stride_k_tok,
            k_norm_ptr,
            stride_k_head,
            num_kv_heads,
            cos,
            sin,
            eps,
            HALF,
            HAS_NORM,
            BLOCK_HK,
            HALF_PAD,
        )
        k1 = k1.to(key_ptr.dtype.element_ty)
        k2 = k2.to(key_ptr.dtype.element_ty)
        tl.store(k_ptrs, k1, mask=k_mask)
        tl.store(k_ptrs + HALF, k2, mask=k_mask)

        slot = tl.load(slot_mapping_ptr + tok)
        if slot >= 0:
            offs_h = tl.arange(0, BLOCK_HK)
            cache_offs = (
                (slot // block_size) * stride_cache_block
                + (slot % block_size) * stride_cache_slot
                + offs_h[:, None] * stride_cache_head
                + offs_d[None, :]
            )
            cache_dtype = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + cache_offs, to_cache_dtype(k1, cache_dtype), mask=k_mask)
            tl.store(k_cache_ptr + cache_offs + HALF, to_cache_dtype(k2, cache_dtype), mask=k_mask)
            v_ptrs = (
                value_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :]
            )
            v1 = tl.load(v_ptrs, mask=k_mask)
            v2 = tl.load(v_ptrs + HALF, mask=k_mask)
            tl.store(v_cache_ptr + cache_offs, to_cache_dtype(v1, cache_dtype), mask=k_mask)
            tl.store(v_cache_ptr + cache_offs + HALF, to_cache_dtype(v2, cache_dtype), mask=k_mask)


def _check_heads(t: torch.Tensor, name: str, num_tokens: int, head_dim: int) -> None:
    if (
        t.dim() != 3
        or t.shape[0] != num_tokens
        or t.shape[2] != head_dim
        or t.stride(-1) != 1
        or t.dtype not in FLOAT_DTYPES
    ):
        raise ValueError(
            f"{name} must be [{num_tokens}, heads, {head_dim}] fp16/bf16/fp32 with stride(-1) == 1,"
            f" got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
        )


def _check_table(t: torch.Tensor, name: str, half: int, device: torch.device) -> None:
    if t.dim() != 2 or t.shape[1] != half or t.dtype != torch.float32 or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be [rows, {half}] (head_dim // 2) fp32 with stride(1) == 1, got "
            f"{tuple(t.shape)} {t.dtype} strides {t.stride()}"
        )
    if t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got {query.shape}")
    num_tokens, num_heads, head_dim = query.shape
    if num_heads < 1 or key.dim() != 3 or key.shape[1] < 1:
        raise ValueError(
            f"query and key need at least one head, got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    if head_dim < 2 or head_dim % 2 or head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be even and in [2, {MAX_HEAD_DIM}], got {head_dim}")
    _check_heads(query, "query", num_tokens, head_dim)
    _check_heads(key, "key", num_tokens, head_dim)
    if value.shape != key.shape or value.dtype != key.dtype or value.stride(-1) != 1:
        raise ValueError(
            f"value must match key ({tuple(key.shape)}, {key.dtype}) with stride(-1) == 1, got "
            f"{tuple(value.shape)} {value.dtype} strides {value.stride()}"
        )
    if key.dtype != query.dtype:
        raise ValueError(f"key dtype {key.dtype} must equal query dtype {query.dtype}")


def _check_rotary_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
) -> torch.device:
    """Raises ValueError naming the first malformed argument, else returns the tensors' device."""
    _check_qkv(query, key, value)
    num_tokens, _, head_dim = query.shape
    half = head_dim // 2
    device = query.device
    _check_table(cos, "cos", half, device)
    _check_table(sin, "sin", half, device)
    if positions is not None and (
        positions.shape != (num_tokens,)
        or positions.dtype != torch.int64
        or not positions.is_contiguous()
    ):
        raise ValueError(
            f"positions must be contiguous int64 of shape [{num_tokens}] (num_tokens), got "
            f"{tuple(positions.shape)} {positions.dtype}"
        )
    if (positions is None and cos.shape[0] < num_tokens) or sin.shape[0] != cos.shape[0]:
        raise ValueError(
            f"cos and sin must have equal rows, >= num_tokens ({num_tokens}) when positions is "
            f"None, got {cos.shape[0]} and {sin.shape[0]}"
        )
    check_cache_args(kv_cache, slot_mapping, num_tokens, key.shape[1], head_dim)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must be given together")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (
            w.shape != (head_dim,) or w.dtype != query.dtype or not w.is_contiguous()
        ):
            raise ValueError(
                f"{name} must be contiguous [{head_dim}] {query.dtype}, got {tuple(w.shape)} "
                f"{w.dtype}"
            )
    if q_norm_weight is not None and not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")
    others = [key, value, kv_cache, slot_mapping]
    others += [t for t in (positions, q_norm_weight, k_norm_weight) if t is not None]
    for t in others:
        if t.device != device:
            raise ValueError(f"all tensors must be on {device}, got one on {t.device}")
    return device


def _launch_rotary_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    device: torch.device,
) -> None:
    """Picks the query heads a program rotates and the warps, and launches the kernel."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = head_dim // 2
    has_norm = q_norm_weight is not None
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_hq = min(triton.next_power_of_2(num_heads), Q_HEADS_PER_PROGRAM)
    _rotary_kv_kernel[(num_tokens, triton.cdiv(num_heads, block_hq) + 1)](
        query,
        key,
        value,
        k_cache,
        v_cache,
        positions if positions is not None else slot_mapping,
        slot_mapping,
        cos,
        sin,
        q_norm_weight if has_norm else query,
        k_norm_weight if has_norm else key,
        num_heads,
        num_kv_heads,
        kv_cache.shape[2],
        eps,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        cos.stride(0),
        sin.stride(0),
        HALF=half,
        HAS_POSITIONS=positions is not None,
        HAS_NORM=has_norm,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4 if num_heads * head_dim >= 2048 else 1,
        **pdl_launch_args(device),
    )


def rotary_kv(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_rows, head_dim // 2] fp32
    sin: torch.Tensor,  # [num_rows, head_dim // 2] fp32
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    positions: torch.Tensor | None = None,  # [num_tokens] int64
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]
    k_norm_weight: torch.Tensor | None = None,  # [head_dim]
    eps: float = 1e-6,
) -> None:
    """Optional per-head q/k RMSNorm, then RoPE on q and k in place, then the KV-cache write.
    cos / sin are whole tables indexed by `positions` (e.g. the halves of a [max_position,
    head_dim] cos|sin cache) or, with positions None, rows gathered per token (num_rows >=
    num_tokens), not bounds-checked on the device. Rotary dim is head_dim (no partial rotary)."""
    device = _check_rotary_args(
        query,
        key,
        value,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        positions,
        q_norm_weight,
        k_norm_weight,
        eps,
    )
    if query.shape[0] == 0:
        return
    _launch_rotary_kv(
        query,
        key,
        value,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        positions,
        q_norm_weight,
        k_norm_weight,
        eps,
        device,
    )
