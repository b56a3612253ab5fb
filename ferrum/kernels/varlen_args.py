"""Checks of the packed variable-length batch arguments shared by the sequence-state kernels
(gated delta rule prefill, causal conv1d prefill): sequence i owns tokens
cu_seqlens[i]:cu_seqlens[i+1] of the token batch."""

from __future__ import annotations

import torch


def check_varlen_args(
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    device: torch.device,
) -> int:
    """Checks cu_seqlens [num_seqs + 1] int32 and has_initial_state [num_seqs] bool; returns
    num_seqs. cu_seqlens values are not read back (no host sync): they must be non-decreasing,
    from 0 to at most the number of tokens."""
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"cu_seqlens must be int32 [num_seqs + 1], got {tuple(cu_seqlens.shape)} "
            f"{cu_seqlens.dtype}"
        )
    if not cu_seqlens.is_contiguous() or cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be contiguous on {device}")
    num_seqs = cu_seqlens.shape[0] - 1
    if has_initial_state is not None and (
        has_initial_state.shape != (num_seqs,)
        or has_initial_state.dtype != torch.bool
        or has_initial_state.device != device
    ):
        raise ValueError(
            f"has_initial_state must be bool [{num_seqs}] on {device}, got "
            f"{tuple(has_initial_state.shape)} {has_initial_state.dtype}"
        )
    return num_seqs
