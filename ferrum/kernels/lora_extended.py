"""Triton LoRA expand after an extended weight's GEMM. A model-dtype layer with adapters keeps
every slot's A below its own rows: W_ext = [W; A_0; ...; A_{L-1}], [N + L*S*R, K] for L slots of
S shards (q/k/v, gate/up) of rank R. One GEMM then gives y_ext = x @ W_ext^T: the base output in
columns [0, N) and, from column N + (s*S + j)*R, every slot s's shard-j t = x A_s,j^T, reduced in
the GEMM's fp32 accumulator and rounded once to the model dtype. This kernel writes the layer's
output y [T, N] = y_ext[:, :N] + t[slot] @ B[slot]^T per shard, in token order: program (m, n)
copies its rows' column block and adds every row's product in one dot over groups of slots
(K = slot x rank; each row's t masked to its own slot's columns, B loaded only for the slots the
rows hold). No grouping, no partials, no counters;
the grid follows the token count and N alone (CUDA graphs replay any mix)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES
from ferrum.kernels.lora_segments import block_m
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

MAX_SLICES = 3
# K of one dot: the slots of a group times the padded rank (8 slots of rank 16: one dot).
DOT_K = 128


@triton.jit
def _lora_expand_extended_kernel(
    y_ext_ptr,  # [num_tokens, N + num_slots * NUM_SLICES * R]
    b_ptr,  # [num_slots, N, R]
    slots_ptr,  # [>= num_tokens] int32, -1: no adapter
    y_ptr,  # [num_tokens, N]
    num_tokens,
    N,
    R,
    num_slots,
    slice1,  # first column of shard 1 (NUM_SLICES >= 2)
    slice2,  # first column of shard 2 (NUM_SLICES == 3)
    stride_ext,
    stride_b_slot,
    stride_b_n,
    stride_y,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLOT_GROUP: tl.constexpr,  # slots one dot covers (SLOT_GROUP * BLOCK_R of K)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding)
    USE_PDL: tl.constexpr,
):
    # Reads nothing before the wait: y_ext and the slot map are written by the step's kernels.
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < num_tokens
    rows = offs_m.to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    slots = tl.load(slots_ptr + offs_m, mask=mask_m, other=-1)
    mask = mask_m[:, None] & mask_n[None, :]
    acc = tl.load(y_ext_ptr + rows[:, None] * stride_ext + offs_n[None, :], mask=mask, other=0.0)
    acc = acc.to(tl.float32)
    # One dot covers SLOT_GROUP slots: K column (g, r) is slot g0 + g's rank r; a row's t is
    # masked to its own slot's columns, B loaded only for the slots these rows hold.
    offs_k = tl.arange(0, SLOT_GROUP * BLOCK_R)
    k_group, k_r = offs_k // BLOCK_R, offs_k % BLOCK_R
    t_rows = y_ext_ptr + rows[:, None] * stride_ext + N
    for j in tl.static_range(NUM_SLICES):
        lo = 0 if j == 0 else (slice1 if j == 1 else slice2)
        hi = N if j + 1 == NUM_SLICES else (slice1 if j == 0 else slice2)
        if (n0 < hi) & (n0 + BLOCK_N > lo):  # only the shards this column block overlaps
            cols = mask_n & (offs_n >= lo) & (offs_n < hi)
            for g0 in range(0, num_slots, SLOT_GROUP):
                k_slot = g0 + k_group
                mine = (slots[:, None] == k_slot[None, :]) & (k_r < R)[None, :]
                held = tl.max(mine.to(tl.int32), 0) > 0  # [K]: a slot these rows hold
                if tl.max(held.to(tl.int32), 0) > 0:
                    tt = tl.load(t_rows + ((k_slot * NUM_SLICES + j) * R + k_r)[None, :],
                                 mask=mine, other=0.0)  # fmt: skip
                    b_cols = k_slot.to(tl.int64) * stride_b_slot + k_r
                    bt = tl.load(
                        b_ptr + b_cols[:, None] + offs_n[None, :] * stride_b_n,
                        mask=held[:, None] & cols[None, :],
                        other=0.0,
                    )
                    acc += tl.dot(tt, bt, input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def check_extended(
    y_ext: torch.Tensor, n: int, lora_b: torch.Tensor, slice_starts: tuple[int, ...]
) -> None:
    """Raises a ValueError naming the argument that does not fit an extended GEMM's output."""
    num_slices = len(slice_starts)
    if lora_b.dim() != 3 or lora_b.shape[1] != n:
        raise ValueError(f"lora_b {tuple(lora_b.shape)}: [L, N, R] with N={n}")
    num_slots, _, rank = lora_b.shape
    if y_ext.dim() != 2 or y_ext.shape[1] != n + num_slots * num_slices * rank:
        raise ValueError(
            f"y_ext {tuple(y_ext.shape)}: [T, N + L*S*R] = [T, {n + num_slots * num_slices * rank}]"
        )
    if (
        not 1 <= num_slices <= MAX_SLICES
        or slice_starts[0] != 0
        or list(slice_starts) != sorted(set(slice_starts))
        or slice_starts[-1] >= n
    ):
        raise ValueError(f"slice_starts: 0 then increasing columns < {n}, at most {MAX_SLICES}")
    if lora_b.dtype not in FLOAT_DTYPES or y_ext.dtype != lora_b.dtype:
        raise ValueError(f"y_ext, lora_b: one float dtype, got {y_ext.dtype}, {lora_b.dtype}")


def lora_expand_extended(
    y_ext: torch.Tensor,
    n: int,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_starts: tuple[int, ...] = (0,),
    block_n: int = 128,
    num_warps: int = 4,
    tile_m: int | None = None,
) -> torch.Tensor:
    """y [T, N] (new, contiguous) from an extended GEMM's y_ext [T, N + L*S*R] (module
    docstring), lora_b [L, N, R] (scaling folded in) and token_slots [>= T] (-1: none)."""
    check_extended(y_ext, n, lora_b, slice_starts)
    if y_ext.stride(1) != 1 or lora_b.stride(2) != 1:
        raise ValueError("y_ext and lora_b: the last dimension must be contiguous")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n: a power of two >= 16, got {block_n}")
    num_tokens = y_ext.shape[0]
    if token_slots.shape[0] < num_tokens or token_slots.dtype != torch.int32:
        raise ValueError(f"token_slots: int32, at least {num_tokens} entries")
    y = torch.empty(num_tokens, n, dtype=y_ext.dtype, device=y_ext.device)
    if num_tokens == 0:
        return y
    num_slots, _, rank = lora_b.shape
    starts = (*slice_starts[1:], 0, 0)
    tile_m = block_m(num_tokens) if tile_m is None else tile_m
    block_r = max(16, triton.next_power_of_2(rank))
    slot_group = min(triton.next_power_of_2(num_slots), max(1, DOT_K // block_r))
    grid = (triton.cdiv(num_tokens, tile_m), triton.cdiv(n, block_n))
    _lora_expand_extended_kernel[grid](
        y_ext, lora_b, token_slots, y, num_tokens, n, rank, num_slots, starts[0], starts[1],
        y_ext.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        NUM_SLICES=len(slice_starts), BLOCK_M=tile_m, BLOCK_N=block_n,
        BLOCK_R=block_r, SLOT_GROUP=slot_group,
        DOT_PRECISION="ieee" if y_ext.dtype == torch.float32 else "tf32", num_warps=num_warps,
        **pdl_launch_args(y_ext.device),
    )  # fmt: skip
    return y
