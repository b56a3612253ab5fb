"""Torch reference for dynamic FP8 activation quantization (per token-group, per token)."""

from __future__ import annotations

import torch

from ferrum.kernels.fp8_quant import AMAX_FLOOR, FP8_DTYPE, FP8_MAX, GROUP_SIZE


def _quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., group] fp32 -> (fp8 codes, scales [..., 1]), one scale per last-dim group."""
    amax = x.abs().amax(-1, keepdim=True).clamp(min=AMAX_FLOOR)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal (not IEEE).
    scale = amax / torch.full_like(amax, FP8_MAX)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def per_token_group_quant_fp8_ref(
    x: torch.Tensor,  # [num_rows, hidden]
    group_size: int = GROUP_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [num_rows, hidden] fp8, scales [num_rows, hidden // group_size] fp32)."""
    num_rows, hidden = x.shape
    q, scale = _quantize_groups(x.float().reshape(num_rows, hidden // group_size, group_size))
    return q.reshape(num_rows, hidden), scale.squeeze(-1)


def per_token_quant_fp8_ref(
    x: torch.Tensor,  # [num_rows, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [num_rows, hidden] fp8, scales [num_rows, 1] fp32)."""
    return _quantize_groups(x.float())


def dequantize_per_token_group_ref(
    q: torch.Tensor,  # [num_rows, hidden] fp8
    scales: torch.Tensor,  # [num_rows, hidden // group_size] fp32, or [num_rows, 1] per token
) -> torch.Tensor:
    """fp32 q[r, c] * scales[r, c // (hidden // num_scale_columns)]."""
    group = q.shape[1] // scales.shape[1]
    return q.float() * scales.float().repeat_interleave(group, dim=1)
