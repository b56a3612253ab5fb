"""Torch reference for `moe_align_block_size`, the oracle for the Triton align kernels (the
contract, outputs and padding: moe_align.py)."""

from __future__ import annotations

import torch

from ferrum.kernels.moe_align import max_num_blocks


def moe_align_block_size_ref(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32/int64 expert ids in [0, num_experts)
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (sorted_pair_ids int32, expert_ids int32, num_pairs_post_padded int32 [1])."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    num_blocks = max_num_blocks(num_pairs, num_experts, block_m)

    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded_counts, 0)
    padded_starts = padded_ends - padded_counts
    starts = torch.cumsum(counts, 0) - counts

    # Stable: pairs of one expert keep ascending pair order.
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - starts[sorted_experts]
    sorted_pair_ids = torch.full(
        (num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device
    )
    sorted_pair_ids[padded_starts[sorted_experts] + rank] = order.to(torch.int32)

    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    total = padded_ends[-1:]
    expert_ids = torch.where(block_starts < total, block_experts, -1).to(torch.int32)
    return sorted_pair_ids, expert_ids, total.to(torch.int32)
