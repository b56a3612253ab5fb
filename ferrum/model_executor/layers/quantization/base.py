"""The contract between a linear layer and its weight format: a LinearMethod object the layer
holds, chosen when the model is built (layers/quantization/__init__.py picks it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows

# device -> the seeded generator dummy weights on that device draw from.
GeneratorFor = Callable[[torch.device], torch.Generator]


class LinearMethod(Protocol):
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        """Registers the layer's weight parameters (`weight`, and its scales), each with a
        weight loader; the layer adds `bias` itself."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Runs once after the checkpoint (or dummy weights) filled the parameters."""

    def fill_dummy_weights(self, layer: nn.Module, std: float, generator: GeneratorFor) -> None:
        """Random weights of std `std` in this format, for parameters the generic dummy
        initialisation skips (those marked `param.dummy_by_layer`)."""

    def takes_fp8_rows(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether `apply` on x (the rows about to be computed: shape, dtype, device) reads
        `x_fp8`, x quantized per token-group of 128, in place of quantizing x itself; the layer
        before (an RMSNorm, a SiLU-and-mul, the attention) then writes those rows alongside x."""

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        x_fp8: Fp8GroupRows | None = None,
    ) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size] in x's dtype. `x_fp8`, when given, holds x's
        rows quantized per token-group of 128 (callers pass it where `takes_fp8_rows` said so)."""
