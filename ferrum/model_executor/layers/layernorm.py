"""RMSNorm, with an optional fused residual add. Normalisation runs in float32 as in HF."""

from __future__ import annotations

import torch
from torch import nn

from ferrum.kernels.rms_norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from ferrum.model_executor.kernel_backend import TritonKernels
from ferrum.model_executor.layers.linear import new_parameter


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, kernels: TritonKernels | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size)
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)` -> normed; `norm(x, residual)` -> (normed(x + residual), x + residual).

        The Triton path of the fused form works in place: x becomes the normed sum, residual
        the sum.
        """
        if self.kernels is not None:
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps)
            self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        return fused_add_rms_norm_ref(x, residual, self.weight, self.eps)
