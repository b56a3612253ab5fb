"""Gated activations."""

from __future__ import annotations

import torch
from torch import nn

from ferrum.kernels.activation_ref import silu_and_mul_ref
from ferrum.model_executor.kernel_backend import TritonKernels

SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class SiluAndMul(nn.Module):
    def __init__(self, kernels: TritonKernels | None) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., 2 * d] holding gate then up; returns silu(gate) * up: [..., d]."""
        if self.kernels is not None and x.dim() == 2:
            return self.kernels.silu_and_mul(x)
        return silu_and_mul_ref(x)


class GeluTanhAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma); torch ops on every backend (no Triton kernel)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., 2 * d] holding gate then up; returns [..., d]."""
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up


def get_act_and_mul(hidden_act: str, kernels: TritonKernels | None) -> nn.Module:
    if hidden_act == "silu":
        return SiluAndMul(kernels)
    if hidden_act == "gelu_pytorch_tanh":
        return GeluTanhAndMul()
    raise ValueError(
        f"hidden_act: {hidden_act!r} is not supported; supported: {list(SUPPORTED_ACTIVATIONS)}"
    )
