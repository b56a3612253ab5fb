"""Triton LoRA shrink over a batch mixing adapters: out[i] = x[i] @ A[slot[i]]^T (fp32) for every
token with an adapter (rows of tokens without one are left unwritten: the expand never reads
them). Program (b, n, j) multiplies the b-th token block (`lora_tiles.py`: block m of slot s's
tokens, gathered through `LoRASegments`) by columns block n of A[s] over the j-th of num_splits
slices of K (a decode step splits K: else one program per slot would walk all of it alone).
Split programs write fp32 partials; the last of a tile's num_splits to arrive
(`arrival_counters.py`) sums them in split order: deterministic, and nothing is zeroed first.
A program past the step's last token block does nothing. The grid depends on the token count and
shapes only, never on which adapters the step holds (CUDA graphs replay any mix)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES
from ferrum.kernels.arrival_counters import arrival_counters
from ferrum.kernels.device_properties import device_properties
from ferrum.kernels.lora_segments import LoRASegments, block_m
from ferrum.kernels.lora_tiles import max_token_blocks, slot_block, slot_rows
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from ferrum.kernels.split_k_sum import last_to_arrive

BLOCK_K = 64
MAX_SPLITS = 32
SPLIT_MIN_K = 256
PROGRAMS_PER_SM = 2


@triton.jit
def _lora_shrink_kernel(
    x_ptr,  # [num_tokens, K]
    a_ptr,  # [num_slots, N, K]
    out_ptr,  # [num_tokens, N] fp32
    partial_ptr,  # [num_splits, num_tokens, N] fp32, used when SPLIT
    counter_ptr,  # [>= tiles] int32, zero between launches, used when SPLIT
    sorted_ptr,  # [num_tokens] int32
    start_ptr,  # [num_slots] int32
    count_ptr,  # [num_slots] int32
    N,
    K,
    num_slots,
    k_per_split,  # a multiple of BLOCK_K
    num_splits,  # K slices: a runtime value (long chunks take any count), SPLIT when > 1
    stride_x,
    stride_a_slot,
    stride_a_n,
    stride_out,
    stride_partial,  # one split's [num_tokens, N] block
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    SLOTS_P2: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32 rounding)
    USE_PDL: tl.constexpr,
):
    # Reads nothing before the wait: the slot map and x are written by the step's kernels.
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    slot, pid_m = slot_block(count_ptr, tl.program_id(0), num_slots, SLOTS_P2, BLOCK_M)
    pid_n = tl.program_id(1)
    k_begin = tl.program_id(2) * k_per_split
    if slot < num_slots:
        count = tl.load(count_ptr + slot)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows, mask_m = slot_rows(sorted_ptr, start_ptr, slot, offs_m, count)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        a_base = a_ptr + slot.to(tl.int64) * stride_a_slot
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            offs_k = k_begin + k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            xt = tl.load(
                x_ptr + rows[:, None] * stride_x + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :],
                other=0.0,
            )
            at = tl.load(
                a_base + offs_n[None, :] * stride_a_n + offs_k[:, None],
                mask=mask_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            acc += tl.dot(xt, at, input_precision=DOT_PRECISION)
        tile = rows[:, None] * stride_out + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if SPLIT:
            tl.store(partial_ptr + tl.program_id(2) * stride_partial + tile, acc, mask)
            counter = counter_ptr + tl.program_id(0) * tl.num_programs(1) + pid_n
            if not last_to_arrive(counter, num_splits):
                return
            acc = tl.load(partial_ptr + tile, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, num_splits):
                acc += tl.load(
                    partial_ptr + s * stride_partial + tile,
                    mask=mask,
                    other=0.0,
                    cache_modifier=".cg",
                )
            tl.store(counter, 0)
        tl.store(out_ptr + tile, acc, mask=mask)


def split_k(token_blocks: int, col_blocks: int, k: int, num_sms: int) -> int:
    """K slices: enough that the launch's programs (token blocks x column blocks x slices) fill
    every SM twice, each slice at least SPLIT_MIN_K of K, at most MAX_SPLITS (a decode step:
    the most; a long prompt chunk: a few, where one program per block would walk all of K while
    most SMs idle). A rule of the shapes and the device alone (CUDA-graph safe)."""
    most = max(1, min(MAX_SPLITS, k // SPLIT_MIN_K))
    return max(1, min(most, triton.cdiv(PROGRAMS_PER_SM * num_sms, token_blocks * col_blocks)))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, segments: LoRASegments) -> torch.Tensor:
    """x [T, K], lora_a [L, N, K] (last dim contiguous) -> [T, N] fp32 (rows of tokens without an
    adapter undefined); `segments` filled from this batch's token slots."""
    if x.dim() != 2 or lora_a.dim() != 3 or x.shape[1] != lora_a.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} and lora_a {tuple(lora_a.shape)}: [T, K], [L, N, K]")
    if x.dtype not in FLOAT_DTYPES or lora_a.dtype != x.dtype:
        raise ValueError(f"x and lora_a: one float dtype, got {x.dtype} and {lora_a.dtype}")
    if x.stride(1) != 1 or lora_a.stride(2) != 1:
        raise ValueError("x and lora_a: the last dimension must be contiguous")
    num_tokens, k = x.shape
    num_slots, n, _ = lora_a.shape
    out = torch.empty(num_tokens, n, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    block_n = max(16, min(64, triton.next_power_of_2(n)))
    tile_m = block_m(num_tokens)
    props = device_properties(x.device)  # None off CUDA: one nominal SM
    splits = split_k(triton.cdiv(num_tokens, tile_m), triton.cdiv(n, block_n), k,
                     props.num_sms if props is not None else 1)  # fmt: skip
    k_per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, k_per_split)  # no slice left empty by the rounding
    grid = (max_token_blocks(num_tokens, tile_m, num_slots), triton.cdiv(n, block_n), splits)
    if splits > 1:
        partials = torch.empty(splits, num_tokens, n, dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, grid[0] * grid[1], "LoRA shrink")
    else:
        partials, counters = out, segments.slot_counts  # unread
    _lora_shrink_kernel[grid](
        x, lora_a, out, partials, counters, segments.sorted_tokens, segments.slot_starts,
        segments.slot_counts, n, k, num_slots, k_per_split, splits, x.stride(0), lora_a.stride(0),
        lora_a.stride(1), out.stride(0), num_tokens * n,
        BLOCK_M=tile_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, SPLIT=splits > 1,
        SLOTS_P2=triton.next_power_of_2(num_slots),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **pdl_launch_args(x.device),
    )  # fmt: skip
    return out
