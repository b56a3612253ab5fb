"""RMSNorm, with an optional fused residual add. Normalisation runs in float32 as in HF."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrum.model_executor.layers.linear import (
    default_weight_loader,
    new_parameter,
    set_weight_loader,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim; statistics in float32, the result
    cast back to x's dtype before the weight multiply."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual); the add is in x's dtype."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size)
        set_weight_loader(self.weight, default_weight_loader)
        self._kernels: Any = None

    def use_triton_kernels(self) -> None:
        from ferrum.kernels import rms_norm as kernels

        self._kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)` -> normed; `norm(x, residual)` -> (normed(x + residual), x + residual).

        The Triton path of the fused form works in place: x becomes the normed sum, residual
        the sum.
        """
        if self._kernels is not None:
            if residual is None:
                return self._kernels.rms_norm(x, self.weight, self.eps)
            self._kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
