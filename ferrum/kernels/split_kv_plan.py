"""The split-KV decode path's plan: its caller-owned workspace, how many parts each request's
context is cut into, and which decode batches take the path (paged_attention_split_kv.py runs
it). Plain torch and arithmetic: the runner sizes the workspace before any kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum.kernels.paged_attention_common import (
    SPLIT_KV_FP8_FACTOR,
    SPLIT_KV_MAX_SPLITS,
    SPLIT_KV_MIN_SEQ_LEN,
    SPLIT_KV_TARGET_PROGRAMS,
    split_kv_max_programs,
)


@dataclass(frozen=True, slots=True)
class SplitKVWorkspace:
    """Caller-owned fp32 scratch for the split-KV decode path, sized once at start-up: partial
    results of up to `max_splits` parts for each of up to `max_num_seqs` decode requests."""

    partial_out: torch.Tensor  # [max_num_seqs, num_heads, max_splits, head_dim] fp32
    partial_max: torch.Tensor  # [max_num_seqs, num_heads, max_splits] fp32
    partial_sum: torch.Tensor  # [max_num_seqs, num_heads, max_splits] fp32

    @property
    def max_num_seqs(self) -> int:
        return self.partial_out.shape[0]

    @property
    def max_splits(self) -> int:
        return self.partial_out.shape[2]


def split_kv_workspace_shapes(
    max_num_seqs: int, num_heads: int, head_dim: int, max_splits: int = SPLIT_KV_MAX_SPLITS
) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
    """Shapes of (partial_out, partial_max == partial_sum) for the split-KV workspace."""
    for name, val in (
        ("max_num_seqs", max_num_seqs),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
        ("max_splits", max_splits),
    ):
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    return (
        (max_num_seqs, num_heads, max_splits, head_dim),
        (max_num_seqs, num_heads, max_splits),
    )


def allocate_split_kv_workspace(
    max_num_seqs: int,
    num_heads: int,
    head_dim: int,
    device: torch.device | str,
    max_splits: int = SPLIT_KV_MAX_SPLITS,
) -> SplitKVWorkspace:
    """Allocates the workspace for `split_kv_workspace_shapes(...)` on `device`."""
    out_shape, stat_shape = split_kv_workspace_shapes(max_num_seqs, num_heads, head_dim, max_splits)
    return SplitKVWorkspace(
        partial_out=torch.empty(out_shape, dtype=torch.float32, device=device),
        partial_max=torch.empty(stat_shape, dtype=torch.float32, device=device),
        partial_sum=torch.empty(stat_shape, dtype=torch.float32, device=device),
    )


def default_num_splits(
    num_reqs: int, num_kv_heads: int, max_splits: int, fp8_cache: bool = False
) -> int:
    """Parts per request so that the batch has about SPLIT_KV_TARGET_PROGRAMS programs
    (SPLIT_KV_FP8_FACTOR times more over an FP8 cache)."""
    target = SPLIT_KV_TARGET_PROGRAMS * (SPLIT_KV_FP8_FACTOR if fp8_cache else 1)
    wanted = -(-target // max(num_reqs * num_kv_heads, 1))
    return max(1, min(max_splits, 1 << (wanted - 1).bit_length()))


def use_split_kv(
    num_reqs: int,
    num_tokens: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    workspace: SplitKVWorkspace | None,
    fp8_cache: bool = False,
) -> bool:
    """True for a decode-only batch too small to fill the GPU (fewer than
    `split_kv_max_programs(fp8_cache)` single-pass programs) whose contexts may be longer than
    SPLIT_KV_MIN_SEQ_LEN, when the workspace holds it."""
    if workspace is None or max_query_len != 1 or num_tokens != num_reqs:
        return False
    return (
        max_seq_len > SPLIT_KV_MIN_SEQ_LEN
        and num_reqs <= workspace.max_num_seqs
        and num_reqs * num_kv_heads < split_kv_max_programs(fp8_cache)
    )
