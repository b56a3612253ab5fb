"""RMSNorm, with an optional fused residual add. Normalisation runs in float32 as in HF."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.kernels.interface import Kernels
from ferrum.model_executor.layers.linear import check_shape, new_parameter, set_weight_loader

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, kernels: Kernels) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size)
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`norm(x)` -> normed; `norm(x, residual)` -> (normed(x + residual), x + residual).

        The fused form works in place: x becomes the normed sum, residual the sum.
        """
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual

    def forward_fp8(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, Fp8GroupRows]:
        """`forward`'s (normed, new residual or None), and the normed rows quantized per
        token-group of 128 for the FP8 layer that reads them. Triton backend only."""
        if residual is None:
            normed, rows = self.kernels.rms_norm_fp8(x, self.weight, self.eps)
            return normed, None, rows
        rows = self.kernels.fused_add_rms_norm_fp8(x, residual, self.weight, self.eps)
        return x, residual, rows


def _load_offset_by_one(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> set:
    if shard_id is not None:
        raise ValueError(f"parameter takes no shard, got shard {shard_id!r}")
    check_shape(param.shape, loaded.shape)
    param.data.copy_(loaded.float() + 1.0)
    return {None}


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm, x / rms(x) * (1 + w): the checkpoint's w is stored as 1 + w at load time
    (in fp32 exactly HF's product; in bf16 the scale is rounded once)."""

    def __init__(self, hidden_size: int, eps: float, kernels: Kernels) -> None:
        super().__init__(hidden_size, eps, kernels)
        set_weight_loader(self.weight, _load_offset_by_one)
