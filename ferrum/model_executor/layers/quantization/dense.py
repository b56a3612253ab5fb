"""The model-dtype weight format: the layer's weight stays as loaded and its product runs
`kernels.dense_linear` (Triton: the one-row GEMV, or the few-row kernel where a tuned table
lists the shape, else F.linear; torch: F.linear)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.kernels.interface import Kernels
from ferrum.model_executor.layers.linear import new_parameter
from ferrum.model_executor.layers.quantization.base import GeneratorFor

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows


class DenseLinearMethod:
    def __init__(self, kernels: Kernels) -> None:
        self._linear = kernels.dense_linear

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        layer.weight = new_parameter(output_size, input_size)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    def fill_dummy_weights(self, layer: nn.Module, std: float, generator: GeneratorFor) -> None:
        return None  # the generic dummy initialisation fills `weight`

    def takes_fp8_rows(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return False

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        x_fp8: Fp8GroupRows | None = None,
    ) -> torch.Tensor:
        if x_fp8 is not None:
            raise ValueError("x_fp8: a model-dtype layer takes no FP8 rows")
        return self._linear(x, layer.weight, bias)
