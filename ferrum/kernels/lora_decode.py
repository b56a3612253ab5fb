"""Triton LoRA for a step of a few tokens (small decode batches): the shrink and the expand in one
launch, added to the base layer's output in place, y[i, cols of shard j] += (x[i] @ A[slot[i],
shard j]^T) @ B[slot[i], cols of shard j]^T. Program (i, n) takes token i and output column block
n; for each shard the block overlaps (one, unless a shard starts inside it) it computes the
token's rank-wide product over all of K itself: every program of a token rereads that rank x K
slice of A (from L2), which costs less at a few tokens than a second launch and the fp32 round
trip between two kernels. The product is rounded to B's dtype as the two-kernel path rounds it.
Tokens without an adapter (slot -1) return at once; the grid depends on the token count only
(CUDA graphs replay any mix). Longer steps take shrink + expand (`LORA_DECODE_MAX_TOKENS`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES
from ferrum.kernels.lora_expand import MAX_SLICES
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

BLOCK_N = 256
# Elements of one [rank, BLOCK_K] tile of A held at once.
_A_TILE = 4096


@triton.jit
def _lora_decode_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [num_slots, NUM_SLICES * RANK, K]
    b_ptr,  # [num_slots, N, RANK]
    y_ptr,  # [num_tokens, N], read and written
    slots_ptr,  # [num_tokens] int32, -1: no adapter
    N,
    K,
    slice1,  # first column of shard 1 (NUM_SLICES >= 2)
    slice2,  # first column of shard 2 (NUM_SLICES == 3)
    stride_x,
    stride_a_slot,
    stride_a_row,
    stride_b_slot,
    stride_b_n,
    stride_y,
    RANK: tl.constexpr,
    RANK_P2: tl.constexpr,
    NUM_SLICES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Reads nothing before the wait: the slot map and x are written by the step's kernels.
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        n0 = tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, RANK_P2)
        mask_r = offs_r < RANK
        a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
        b_base = b_ptr + slot.to(tl.int64) * stride_b_slot
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(NUM_SLICES):
            lo = 0 if j == 0 else (slice1 if j == 1 else slice2)
            hi = N if j + 1 == NUM_SLICES else (slice1 if j == 0 else slice2)
            if (n0 < hi) & (n0 + BLOCK_N > lo):  # only the shards this column block overlaps
                t = tl.zeros((RANK_P2,), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    mask_k = offs_k < K
                    xk = tl.load(x_ptr + token * stride_x + offs_k, mask=mask_k, other=0.0)
                    ak = tl.load(
                        a_base + (j * RANK + offs_r)[:, None] * stride_a_row + offs_k[None, :],
                        mask=mask_r[:, None] & mask_k[None, :],
                        other=0.0,
                    )
                    t += tl.sum(ak.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
                t = t.to(b_ptr.dtype.element_ty).to(tl.float32)
                cols = (offs_n < N) & (offs_n >= lo) & (offs_n < hi)
                bt = tl.load(
                    b_base + offs_n[:, None] * stride_b_n + offs_r[None, :],
                    mask=cols[:, None] & mask_r[None, :],
                    other=0.0,
                )
                acc += tl.sum(bt.to(tl.float32) * t[None, :], axis=1)
        y_ptrs = y_ptr + token * stride_y + offs_n
        mask_n = offs_n < N
        y = tl.load(y_ptrs, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask_n)


def lora_decode(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    slice_starts: tuple[int, ...] = (0,),
) -> None:
    """y [T, N] += (x [T, K] @ lora_a[slot]^T) @ lora_b[slot]^T per token with an adapter and
    shard, in place (S shards of rank R: lora_a [L, S * R, K], lora_b [L, N, R], shard j's
    columns from `slice_starts[j]`); `token_slots` [>= T] int32, -1 where a token has none."""
    num_slices = len(slice_starts)
    num_tokens, k = x.shape
    rank, n = lora_b.shape[2], lora_b.shape[1]
    if lora_a.dim() != 3 or lora_a.shape[1:] != (num_slices * rank, k):
        raise ValueError(
            f"lora_a: expected [L, {num_slices * rank}, {k}] for {num_slices} shards of rank "
            f"{rank}, got {tuple(lora_a.shape)}"
        )
    if y.shape != (num_tokens, n) or token_slots.shape[0] < num_tokens:
        raise ValueError(f"y [{num_tokens}, {n}] and token_slots [>= {num_tokens}] expected")
    if not 1 <= num_slices <= MAX_SLICES or list(slice_starts) != sorted(set(slice_starts)):
        raise ValueError(f"slice_starts: 0 then increasing columns < {n}, at most {MAX_SLICES}")
    if slice_starts[0] != 0 or slice_starts[-1] >= n:
        raise ValueError(f"slice_starts: 0 then increasing columns < {n}, at most {MAX_SLICES}")
    if lora_a.dtype not in FLOAT_DTYPES or len({x.dtype, lora_a.dtype, lora_b.dtype, y.dtype}) > 1:
        raise ValueError("x, lora_a, lora_b, y: one float dtype")
    if x.stride(1) != 1 or lora_a.stride(2) != 1 or lora_b.stride(2) != 1 or y.stride(1) != 1:
        raise ValueError("x, lora_a, lora_b and y: the last dimension must be contiguous")
    if num_tokens == 0:
        return
    starts = (*slice_starts[1:], 0, 0)
    rank_p2 = triton.next_power_of_2(rank)
    grid = (num_tokens, triton.cdiv(n, BLOCK_N))
    _lora_decode_kernel[grid](
        x, lora_a, lora_b, y, token_slots, n, k, starts[0], starts[1], x.stride(0),
        lora_a.stride(0), lora_a.stride(1), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        RANK=rank, RANK_P2=rank_p2, NUM_SLICES=num_slices, BLOCK_N=BLOCK_N,
        BLOCK_K=max(16, min(256, _A_TILE // rank_p2, triton.next_power_of_2(k))),
        **pdl_launch_args(x.device),
    )  # fmt: skip
