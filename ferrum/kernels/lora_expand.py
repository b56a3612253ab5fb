"""Triton LoRA expand over a batch mixing adapters, added to the base layer's output in place:
y[i] += t[i] @ B[slot[i]]^T for every token with an adapter (the adapter's scaling is folded into
B). Program (m, n, s) handles block m of slot s's tokens and output columns block n; tokens
without an adapter are never touched. `y` and `t` may be column slices of wider tensors (a merged
layer's shard: its stride is the row stride)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES
from ferrum.kernels.lora_segments import LoRASegments, block_m


@triton.jit
def _lora_expand_kernel(
    t_ptr,  # [num_tokens, K] (row stride stride_t), fp32 or B's dtype
    b_ptr,  # [num_slots, N, K]
    y_ptr,  # [num_tokens, N] (row stride stride_y), read and written
    sorted_ptr,  # [num_tokens] int32
    start_ptr,  # [num_slots] int32
    count_ptr,  # [num_slots] int32
    N,
    K,
    stride_t,
    stride_b_slot,
    stride_b_n,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if pid_m * BLOCK_M < count:
        start = tl.load(start_ptr + slot)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < count
        rows = tl.load(sorted_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        b_base = b_ptr + slot.to(tl.int64) * stride_b_slot
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            tt = tl.load(
                t_ptr + rows[:, None] * stride_t + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            ).to(b_ptr.dtype.element_ty)
            bt = tl.load(
                b_base + offs_n[None, :] * stride_b_n + offs_k[:, None],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            acc += tl.dot(tt, bt, input_precision=DOT_PRECISION)
        y_ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_expand(
    t: torch.Tensor, lora_b: torch.Tensor, segments: LoRASegments, y: torch.Tensor
) -> None:
    """y [T, N] += t [T, K] @ lora_b[slot] [N, K]^T per token with an adapter, in place (t in
    fp32, as the shrink writes it, is rounded to B's dtype for the product)."""
    if t.dim() != 2 or lora_b.dim() != 3 or t.shape[1] != lora_b.shape[2]:
        raise ValueError(f"t {tuple(t.shape)} and lora_b {tuple(lora_b.shape)}: [T, K], [L, N, K]")
    if y.shape != (t.shape[0], lora_b.shape[1]):
        raise ValueError(f"y: expected shape {(t.shape[0], lora_b.shape[1])}, got {tuple(y.shape)}")
    if lora_b.dtype not in FLOAT_DTYPES or y.dtype != lora_b.dtype:
        raise ValueError(f"lora_b, y: one float dtype, got {lora_b.dtype}, {y.dtype}")
    if t.dtype not in (lora_b.dtype, torch.float32):
        raise ValueError(f"t: float32 (the shrink's) or lora_b's dtype, got {t.dtype}")
    if t.stride(1) != 1 or lora_b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("t, lora_b and y: the last dimension must be contiguous")
    num_tokens, k = t.shape
    num_slots, n, _ = lora_b.shape
    if num_tokens == 0:
        return
    block_n = 64
    tile_m = block_m(num_tokens)
    grid = (triton.cdiv(num_tokens, tile_m), triton.cdiv(n, block_n), num_slots)
    _lora_expand_kernel[grid](
        t, lora_b, y, segments.sorted_tokens, segments.slot_starts, segments.slot_counts,
        n, k, t.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=tile_m, BLOCK_N=block_n, BLOCK_K=max(16, min(64, triton.next_power_of_2(k))),
        DOT_PRECISION="ieee" if lora_b.dtype == torch.float32 else "tf32",
    )  # fmt: skip
