"""Triton LoRA expand over a batch mixing adapters: y[i, cols of shard j] += t[i, j-th K block] @
B[slot[i], cols of shard j]^T for every token with an adapter (the adapter's scaling is folded
into B). A merged layer's shards (q/k/v, gate/up: up to 3, consecutive column ranges starting at
`slice_starts`) take one launch: each program computes its column block's part of the shards it
overlaps. Program (b, n) handles the b-th token block (`lora_tiles.py`: block m of slot s's tokens)
and output columns block n. Two forms: `lora_expand` adds the shrink's t to the base output in
place (tokens without an adapter untouched); `lora_expand_extended` reads an extended weight's
GEMM output (a model-dtype layer keeps every slot's A as rows below W, so one GEMM gave the base
output and every slot's t beside it) and writes the layer's output apart, its first programs
copying the rows of tokens without an adapter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES
from ferrum.kernels.lora_segments import LoRASegments, block_m
from ferrum.kernels.lora_tiles import max_token_blocks, slot_block, slot_rows
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

MAX_SLICES = 3


@triton.jit
def _copy_unadapted(src_ptr, y_ptr, sorted_ptr, count_ptr, block, offs_n, mask_n, num_tokens,
                    num_slots, stride_src, stride_y, BLOCK_M: tl.constexpr,
                    SLOTS_P2: tl.constexpr):  # fmt: skip
    """Tokens without an adapter sort first (positions [0, unadapted)): the `block`-th block of
    them is copied from src to y as it is. Returns how many such blocks there are."""
    idx = tl.arange(0, SLOTS_P2)
    counts = tl.load(count_ptr + idx, mask=idx < num_slots, other=0)
    unadapted = num_tokens - tl.sum(counts, 0)
    copy_blocks = (unadapted + BLOCK_M - 1) // BLOCK_M
    if block < copy_blocks:
        offs = block * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs < unadapted
        rows = tl.load(sorted_ptr + offs, mask=mask_m, other=0).to(tl.int64)
        mask = mask_m[:, None] & mask_n[None, :]
        src = tl.load(src_ptr + rows[:, None] * stride_src + offs_n[None, :], mask=mask)
        tl.store(y_ptr + rows[:, None] * stride_y + offs_n[None, :], src, mask=mask)
    return copy_blocks


@triton.jit
def _lora_expand_kernel(
    t_ptr,  # [num_tokens, ...]: row i's shard-j t at column slot * t_slot_stride + j * K
    b_ptr,  # [num_slots, N, K]
    src_ptr,  # [num_tokens, N]: the base output (y itself, in place, unless COPY_UNADAPTED)
    y_ptr,  # [num_tokens, N], written
    sorted_ptr,  # [num_tokens] int32
    start_ptr,  # [num_slots] int32
    count_ptr,  # [num_slots] int32
    N,
    K,
    num_tokens,
    num_slots,
    slice1,  # first column of shard 1 (NUM_SLICES >= 2)
    slice2,  # first column of shard 2 (NUM_SLICES == 3)
    stride_t,
    t_slot_stride,  # 0: t holds each token's own slot's columns (the shrink's output)
    stride_b_slot,
    stride_b_n,
    stride_src,
    stride_y,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SLOTS_P2: tl.constexpr,
    COPY_UNADAPTED: tl.constexpr,  # y is not src: the first programs copy adapterless rows
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding)
    USE_PDL: tl.constexpr,
):
    # Reads nothing before the wait: the slot map, t and src are written by the step's kernels.
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if COPY_UNADAPTED:
        block -= _copy_unadapted(
            src_ptr, y_ptr, sorted_ptr, count_ptr, block, offs_n, mask_n, num_tokens, num_slots,
            stride_src, stride_y, BLOCK_M, SLOTS_P2,
        )  # fmt: skip
    slot, pid_m = slot_block(count_ptr, block, num_slots, SLOTS_P2, BLOCK_M)
    if (slot < num_slots) & (block >= 0):
        count = tl.load(count_ptr + slot)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows, mask_m = slot_rows(sorted_ptr, start_ptr, slot, offs_m, count)
        b_base = b_ptr + slot.to(tl.int64) * stride_b_slot
        t_base = t_ptr + rows[:, None] * stride_t + slot * t_slot_stride
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        n0 = pid_n * BLOCK_N
        for j in tl.static_range(NUM_SLICES):
            lo = 0 if j == 0 else (slice1 if j == 1 else slice2)
            hi = N if j + 1 == NUM_SLICES else (slice1 if j == 0 else slice2)
            if (n0 < hi) & (n0 + BLOCK_N > lo):  # only the shards this column block overlaps
                cols = mask_n & (offs_n >= lo) & (offs_n < hi)
                for k0 in range(0, K, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    mask_k = offs_k < K
                    tt = tl.load(
                        t_base + (j * K + offs_k)[None, :],
                        mask=mask_m[:, None] & mask_k[None, :],
                        other=0.0,
                    ).to(b_ptr.dtype.element_ty)
                    bt = tl.load(
                        b_base + offs_n[None, :] * stride_b_n + offs_k[:, None],
                        mask=mask_k[:, None] & cols[None, :],
                        other=0.0,
                    )
                    acc += tl.dot(tt, bt, input_precision=DOT_PRECISION)
        mask = mask_m[:, None] & mask_n[None, :]
        src = tl.load(src_ptr + rows[:, None] * stride_src + offs_n[None, :], mask=mask, other=0.0)
        y_ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
        tl.store(y_ptrs, (src.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def check_slices(slice_starts: tuple[int, ...], n: int) -> None:
    """Raises a ValueError unless a merged layer's shards start at 0, then at increasing
    columns below n, at most MAX_SLICES of them."""
    if (
        not 1 <= len(slice_starts) <= MAX_SLICES
        or slice_starts[0] != 0
        or list(slice_starts) != sorted(set(slice_starts))
        or slice_starts[-1] >= n
    ):
        raise ValueError(f"slice_starts: 0 then increasing columns < {n}, at most {MAX_SLICES}")


def lora_expand(
    t: torch.Tensor,
    lora_b: torch.Tensor,
    segments: LoRASegments,
    y: torch.Tensor,
    slice_starts: tuple[int, ...] = (0,),
    block_n: int = 128,
    num_warps: int = 4,
) -> None:
    """y [T, N] += t [T, S * K] @ lora_b[slot] [N, K]^T per token with an adapter and shard (S
    shards, starting at columns `slice_starts`), in place; t in fp32, as the shrink writes it,
    is rounded to B's dtype for the product. `block_n` output columns a program, a power of
    two >= 16."""
    num_slices = len(slice_starts)
    if t.dim() != 2 or lora_b.dim() != 3 or t.shape[1] != num_slices * lora_b.shape[2]:
        raise ValueError(
            f"t {tuple(t.shape)} and lora_b {tuple(lora_b.shape)}: [T, S * K], [L, N, K] for "
            f"S={num_slices} shards"
        )
    if y.shape != (t.shape[0], lora_b.shape[1]):
        raise ValueError(f"y: expected shape {(t.shape[0], lora_b.shape[1])}, got {tuple(y.shape)}")
    check_slices(slice_starts, lora_b.shape[1])
    if lora_b.dtype not in FLOAT_DTYPES or y.dtype != lora_b.dtype:
        raise ValueError(f"lora_b, y: one float dtype, got {lora_b.dtype}, {y.dtype}")
    if t.dtype not in (lora_b.dtype, torch.float32):
        raise ValueError(f"t: float32 (the shrink's) or lora_b's dtype, got {t.dtype}")
    _launch(t, 0, lora_b, segments, y, y, slice_starts, block_n, num_warps)


def lora_expand_extended(
    y_ext: torch.Tensor,
    n: int,
    lora_b: torch.Tensor,
    segments: LoRASegments,
    slice_starts: tuple[int, ...] = (0,),
    block_n: int = 128,
    num_warps: int = 4,
) -> torch.Tensor:
    """The layer's output y [T, N] (new, contiguous) from an extended weight's GEMM output
    y_ext [T, N + L*S*R] (W's columns, then slot s's shard-j t at N + (s*S + j)*R): y_ext's
    first N columns plus each adapter token's t @ lora_b[slot]^T per shard."""
    num_slots, num_slices = lora_b.shape[0], len(slice_starts)
    if lora_b.dim() != 3 or lora_b.shape[1] != n:
        raise ValueError(f"lora_b {tuple(lora_b.shape)}: [L, N, R] with N={n}")
    width = n + num_slots * num_slices * lora_b.shape[2]
    if y_ext.dim() != 2 or y_ext.shape[1] != width:
        raise ValueError(f"y_ext {tuple(y_ext.shape)}: [T, N + L*S*R] = [T, {width}]")
    check_slices(slice_starts, n)
    if lora_b.dtype not in FLOAT_DTYPES or y_ext.dtype != lora_b.dtype:
        raise ValueError(f"y_ext, lora_b: one float dtype, got {y_ext.dtype}, {lora_b.dtype}")
    if y_ext.shape[0] > segments.sorted_tokens.numel():
        raise ValueError(
            f"y_ext: {y_ext.shape[0]} tokens, more than the segments' "
            f"{segments.sorted_tokens.numel()}"
        )
    y = torch.empty(y_ext.shape[0], n, dtype=y_ext.dtype, device=y_ext.device)
    t = y_ext[:, n:]
    _launch(t, num_slices * lora_b.shape[2], lora_b, segments, y_ext, y, slice_starts, block_n,
            num_warps)  # fmt: skip
    return y


def _launch(
    t: torch.Tensor,
    t_slot_stride: int,
    lora_b: torch.Tensor,
    segments: LoRASegments,
    src: torch.Tensor,
    y: torch.Tensor,
    slice_starts: tuple[int, ...],
    block_n: int,
    num_warps: int,
) -> None:
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n: a power of two >= 16, got {block_n}")
    if t.stride(1) != 1 or lora_b.stride(2) != 1 or y.stride(1) != 1 or src.stride(1) != 1:
        raise ValueError("t, lora_b, y and y_ext: the last dimension must be contiguous")
    num_tokens, k = t.shape[0], lora_b.shape[2]
    if num_tokens == 0:
        return
    copies = src is not y
    starts = (*slice_starts[1:], 0, 0)
    tile_m = block_m(num_tokens)
    num_slots, n = lora_b.shape[0], lora_b.shape[1]
    grid = (max_token_blocks(num_tokens, tile_m, num_slots + copies), triton.cdiv(n, block_n))
    _lora_expand_kernel[grid](
        t, lora_b, src, y, segments.sorted_tokens, segments.slot_starts, segments.slot_counts,
        n, k, num_tokens, num_slots, starts[0], starts[1], t.stride(0), t_slot_stride,
        lora_b.stride(0), lora_b.stride(1), src.stride(0), y.stride(0),
        NUM_SLICES=len(slice_starts), BLOCK_M=tile_m, BLOCK_N=block_n,
        SLOTS_P2=triton.next_power_of_2(num_slots),
        BLOCK_K=max(16, min(64, triton.next_power_of_2(k))), COPY_UNADAPTED=copies,
        DOT_PRECISION="ieee" if lora_b.dtype == torch.float32 else "tf32", num_warps=num_warps,
        **pdl_launch_args(t.device),
    )  # fmt: skip
