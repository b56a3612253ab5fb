"""Groups (token, choice) pairs (p = t * top_k + j) by expert, on the device with sizes bounded by
(num_pairs, num_experts, block_m): no host sync, CUDA graph safe. `sorted_pair_ids [max_blocks *
block_m]`: expert after expert, its pairs ascending, padded to a multiple of block_m (the GEMM's M
tile) with the sentinel num_pairs; `expert_ids [max_blocks]`: each M-block's expert (-1 past the
used ones); `num_pairs_post_padded [1]`: entries used. Two deterministic launches without atomics
over the same spans (one per program): `count` stores span s's expert histogram in counts[s, :] and
sentinel-fills its share; `scatter` sums counts over all spans (padded starts) and spans < s (its
offsets) and writes each pair to its place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of a chunk's one-hot matrix [CHUNK, BLOCK_E] and of a counts tile [rows, BLOCK_E].
_TILE_ELEMS = 8192
# At most this many spans: each scatter program reads all spans' counts.
_MAX_SPANS = 256
_FILL_BLOCK = 1024


# Most runtime integers follow the step's token count, and Triton would compile a variant per
# pattern of "is 1 / is a multiple of 16" among them: far more than start-up can run. Unspecialised,
# the variants depend on the constexprs only (num_experts is fixed per model, block_m per config).
COUNT_RUNTIME_INTS = ("num_pairs", "num_experts", "num_slots", "chunks_per_span", "slots_per_span")
SCATTER_RUNTIME_INTS = (
    "num_pairs",
    "num_experts",
    "num_spans",
    "num_blocks",
    "block_m",
    "chunks_per_span",
    "blocks_per_span",
)


@triton.jit(do_not_specialize=COUNT_RUNTIME_INTS)
def _moe_align_count_kernel(
    counts_ptr,  # [num_spans, num_experts] int32
    sorted_pair_ids_ptr,  # [num_slots] int32
    topk_ids_ptr,  # [num_pairs] int32/int64
    num_pairs,
    num_experts,
    num_slots,
    chunks_per_span,
    slots_per_span,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    FILL_BLOCK: tl.constexpr,
):
    """Program s: counts[s, e] = #pairs of expert e in span s; sentinel over its slot share."""
    span = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    offs_c = tl.arange(0, CHUNK)
    hist = tl.zeros([BLOCK_E], dtype=tl.int32)
    for i in range(0, chunks_per_span):
        pairs = (span * chunks_per_span + i) * CHUNK + offs_c
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hist += tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), 0)
    tl.store(counts_ptr + span * num_experts + offs_e, hist, mask=offs_e < num_experts)

    sentinel = tl.zeros([FILL_BLOCK], dtype=tl.int32) + num_pairs
    offs_f = tl.arange(0, FILL_BLOCK)
    for f0 in range(0, slots_per_span, FILL_BLOCK):
        slots = span * slots_per_span + f0 + offs_f
        tl.store(
            sorted_pair_ids_ptr + slots,
            sentinel,
            mask=(slots < num_slots) & (f0 + offs_f < slots_per_span),
        )


@triton.jit(do_not_specialize=SCATTER_RUNTIME_INTS)
def _moe_align_scatter_kernel(
    sorted_pair_ids_ptr,  # [num_slots] int32
    expert_ids_ptr,  # [num_blocks] int32
    num_post_padded_ptr,  # [1] int32
    topk_ids_ptr,  # [num_pairs] int32/int64
    counts_ptr,  # [num_spans, num_experts] int32
    num_pairs,
    num_experts,
    num_spans,
    num_blocks,
    block_m,
    chunks_per_span,
    blocks_per_span,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """Program s scatters span s's pairs to their slots and sets expert_ids of its block share."""
    span = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    totals = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    offs_r = tl.arange(0, BLOCK_ROWS)
    for r0 in range(0, num_spans, BLOCK_ROWS):
        rows = r0 + offs_r
        tile = tl.load(
            counts_ptr + rows[:, None] * num_experts + offs_e[None, :],
            mask=(rows < num_spans)[:, None] & e_mask[None, :],
            other=0,
        )
        totals += tl.sum(tile, 0)
        before += tl.sum(tl.where((rows < span)[:, None], tile, 0), 0)
    # Experts past num_experts have padded 0, so their padded_end is the total.
    padded = (totals + block_m - 1) // block_m * block_m
    padded_end = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    tl.store(num_post_padded_ptr, total, mask=span == 0)

    # expert of block b = #experts whose padded group ends at or before b's first slot.
    offs_b = tl.arange(0, BLOCK_ROWS)
    for i in range(0, blocks_per_span, BLOCK_ROWS):
        blocks = span * blocks_per_span + i + offs_b
        first = blocks * block_m
        expert = tl.sum((padded_end[None, :] <= first[:, None]).to(tl.int32), 1)
        tl.store(
            expert_ids_ptr + blocks,
            tl.where(first < total, expert, -1),
            mask=(blocks < num_blocks) & (i + offs_b < blocks_per_span),
        )

    # next_slot[e]: slot of this span's next pair of expert e.
    next_slot = padded_end - padded + before
    offs_c = tl.arange(0, CHUNK)
    earlier = offs_c[None, :] < offs_c[:, None]  # [row, col]: col precedes row in the chunk
    for i in range(0, chunks_per_span):
        pairs = (span * chunks_per_span + i) * CHUNK + offs_c
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        one_hot = ids[:, None] == offs_e[None, :]
        rank = tl.sum(((ids[:, None] == ids[None, :]) & earlier).to(tl.int32), 1)
        slot = tl.sum(tl.where(one_hot, next_slot[None, :], 0), 1) + rank
        valid = (pairs < num_pairs) & (ids >= 0) & (ids < num_experts)
        tl.store(sorted_pair_ids_ptr + slot, pairs, mask=valid)
        next_slot += tl.sum(one_hot.to(tl.int32), 0)


def max_num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(count_e / block_m): at most min(E, num_pairs) groups are
    non-empty and each wastes < one block, so the sum is < num_pairs / block_m + groups."""
    if num_pairs == 0:
        return 0
    return -(-num_pairs // block_m) + min(num_experts, num_pairs) - 1


def _check_inputs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"topk_ids must be [num_tokens, top_k] int32/int64, got {tuple(topk_ids.shape)} "
            f"{topk_ids.dtype}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    if topk_ids.numel() + num_experts * block_m >= 2**31:
        raise ValueError(
            f"topk_ids.numel() + num_experts * block_m must be < 2**31, got "
            f"{topk_ids.numel()} + {num_experts} * {block_m}"
        )


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32/int64 expert ids in [0, num_experts)
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (sorted_pair_ids int32, expert_ids int32, num_pairs_post_padded int32 [1]).
    Pairs whose id lies outside [0, num_experts) are left out of every group."""
    _check_inputs(topk_ids, num_experts, block_m)
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    num_blocks = max_num_blocks(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return sorted_pair_ids, expert_ids, torch.zeros(1, dtype=torch.int32, device=device)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=device)

    block_e = triton.next_power_of_2(num_experts)
    chunk = max(16, min(64, _TILE_ELEMS // block_e))
    num_chunks = triton.cdiv(num_pairs, chunk)
    chunks_per_span = triton.cdiv(num_chunks, _MAX_SPANS)
    num_spans = triton.cdiv(num_chunks, chunks_per_span)
    counts = torch.empty(num_spans, num_experts, dtype=torch.int32, device=device)
    flat_ids = topk_ids.reshape(-1)
    _moe_align_count_kernel[(num_spans,)](
        counts,
        sorted_pair_ids,
        flat_ids,
        num_pairs,
        num_experts,
        sorted_pair_ids.numel(),
        chunks_per_span,
        triton.cdiv(sorted_pair_ids.numel(), num_spans),
        CHUNK=chunk,
        BLOCK_E=block_e,
        FILL_BLOCK=_FILL_BLOCK,
        num_warps=4,
    )
    _moe_align_scatter_kernel[(num_spans,)](
        sorted_pair_ids,
        expert_ids,
        num_post_padded,
        flat_ids,
        counts,
        num_pairs,
        num_experts,
        num_spans,
        num_blocks,
        block_m,
        chunks_per_span,
        triton.cdiv(num_blocks, num_spans),
        CHUNK=chunk,
        BLOCK_E=block_e,
        BLOCK_ROWS=max(1, _TILE_ELEMS // block_e),
        num_warps=4,
    )
    return sorted_pair_ids, expert_ids, num_post_padded
