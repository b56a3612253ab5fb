"""Torch reference for RMSNorm and fused residual-add + RMSNorm (Hugging Face rounding)."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype), the statistics in float32."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [..., hidden]
    residual: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm_ref(residual + x), residual + x), the sum rounded to x's dtype."""
    summed = residual + x
    return rms_norm_ref(summed, weight, eps), summed
