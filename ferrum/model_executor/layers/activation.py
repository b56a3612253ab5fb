"""Gated activations."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.kernels.activation_ref import silu_and_mul_ref
from ferrum.kernels.interface import Kernels

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows

SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class SiluAndMul(nn.Module):
    def __init__(self, kernels: Kernels) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., 2 * d] holding gate then up; returns silu(gate) * up: [..., d]. The kernels
        take rows (2-D x); other shapes run the reference."""
        if x.dim() == 2:
            return self.kernels.silu_and_mul(x)
        return silu_and_mul_ref(x)

    def writes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether `forward_fp8(x)` runs: the Triton kernel on 2-D rows."""
        return self.kernels.is_triton and x.dim() == 2

    def forward_fp8(self, x: torch.Tensor) -> tuple[torch.Tensor, Fp8GroupRows]:
        """`forward(x)` and its rows quantized per token-group of 128 (see writes_fp8_rows)."""
        if not self.writes_fp8_rows(x):
            raise ValueError("SiluAndMul: FP8 rows need the Triton kernel backend and 2-D x")
        return self.kernels.silu_and_mul_fp8(x)


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma); torch ops on every backend (no Triton kernel)."""

    def writes_fp8_rows(self, x: torch.Tensor) -> bool:
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., 2 * d] holding gate then up; returns [..., d]."""
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up


def get_act_and_mul(hidden_act: str, kernels: Kernels) -> nn.Module:
    if hidden_act == "silu":
        return SiluAndMul(kernels)
    if hidden_act == "gelu_pytorch_tanh":
        return GeluTanhAndMul()
    raise ValueError(
        f"hidden_act: {hidden_act!r} is not supported; supported: {list(SUPPORTED_ACTIVATIONS)}"
    )
