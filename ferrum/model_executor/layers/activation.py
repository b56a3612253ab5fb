"""Gated activations."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

SUPPORTED_ACTIVATIONS = ("silu",)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * d] holding gate then up; returns silu(gate) * up: [..., d]."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def use_triton_kernels(self) -> None:
        from ferrum.kernels.activation import silu_and_mul as kernel

        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and x.dim() == 2:
            return self._kernel(x)
        return silu_and_mul(x)


def get_act_and_mul(hidden_act: str) -> nn.Module:
    if hidden_act != "silu":
        raise ValueError(
            f"hidden_act: {hidden_act!r} is not supported; supported: {list(SUPPORTED_ACTIVATIONS)}"
        )
    return SiluAndMul()
