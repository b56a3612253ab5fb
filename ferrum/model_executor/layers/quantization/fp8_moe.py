"""FP8 experts of a FusedMoE layer: e4m3fn `w13` [E, 2I, H] and `w2` [E, H, I] with fp32 scales
per 128x128 block (from `weight_scale_inv`; gate rows then up rows, so I % 128 == 0). Weight-only
(the kernels scale their fp32 sums) or, on the Triton kernels where fused_moe_rule says so, W8A8:
the norm before writes the hidden rows quantized per token-group (`takes_fp8_rows`). The torch
reference dequantizes whole experts. Quantizing on load keeps the stacked experts in the model
dtype until loaded, then quantizes each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.kernels.batch_invariant import fused_moe_row_by_row
from ferrum.kernels.device_properties import device_properties
from ferrum.kernels.fp8_quant import FP8_DTYPE
from ferrum.kernels.fp8_weight import WEIGHT_BLOCK, quantize_weight_block
from ferrum.kernels.fused_moe_ref import fused_moe_ref
from ferrum.kernels.fused_moe_rule import uses_fp8_activations
from ferrum.kernels.interface import Kernels
from ferrum.model_executor.layers.linear import new_parameter, quantized_parameter
from ferrum.model_executor.layers.quantization.base import GeneratorFor
from ferrum.quant_config import QuantConfig

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows

_BLOCK = WEIGHT_BLOCK[0]


class Fp8MoEMethod:
    def __init__(self, quant_config: QuantConfig, kernels: Kernels, layer_name: str) -> None:
        if quant_config.weight_scales != "block":
            raise ValueError(
                f"quantization: FP8 experts with {quant_config.weight_scales} scales "
                f"({layer_name}) are not supported yet; supported: 128x128 block scales"
            )
        self.layer_name = layer_name
        self.quantize_on_load = quant_config.quantize_on_load
        self._kernel = kernels.fused_moe
        self._reference = fused_moe_row_by_row if kernels.batch_invariant else fused_moe_ref
        # W8A8 by token count would make a row's bits depend on its batch: batch-invariant
        # kernels keep the experts weight-only (batch_invariant.py passes fp8_activations=False).
        self._may_take_rows = kernels.is_triton and not kernels.batch_invariant

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int
    ) -> None:
        """Registers w13 and w2 (and their scales); FusedMoE sets their weight loaders."""
        if hidden_size % _BLOCK or intermediate_size % _BLOCK:
            raise ValueError(
                f"quantization: FP8 experts {self.layer_name} need hidden_size and "
                f"moe_intermediate_size multiples of {_BLOCK}, got {hidden_size} and "
                f"{intermediate_size}"
            )
        shapes = {
            "w13": (num_experts, 2 * intermediate_size, hidden_size),
            "w2": (num_experts, hidden_size, intermediate_size),
        }
        for name, shape in shapes.items():
            if self.quantize_on_load:
                setattr(layer, name, new_parameter(*shape))
                continue
            setattr(layer, name, quantized_parameter(torch.empty(shape, dtype=FP8_DTYPE)))
            scale_shape = (shape[0], shape[1] // _BLOCK, shape[2] // _BLOCK)
            scale = torch.empty(scale_shape, dtype=torch.float32)
            setattr(layer, f"{name}_scale", quantized_parameter(scale, _BLOCK))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.quantize_on_load or layer.w13.dtype == FP8_DTYPE:
            return
        for name in ("w13", "w2"):
            weight = getattr(layer, name).data
            codes = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
            scales = []
            for expert in range(weight.shape[0]):
                codes[expert], scale = quantize_weight_block(weight[expert])
                scales.append(scale)
            setattr(layer, name, quantized_parameter(codes))
            setattr(layer, f"{name}_scale", quantized_parameter(torch.stack(scales), _BLOCK))

    def fill_dummy_weights(self, layer: nn.Module, std: float, generator: GeneratorFor) -> None:
        if self.quantize_on_load:
            return  # model-dtype experts until process_weights_after_loading
        for name in ("w13", "w2"):
            weight, scale = getattr(layer, name), getattr(layer, f"{name}_scale")
            values = torch.empty(weight.shape[1:], dtype=torch.float32, device=weight.device)
            for expert in range(weight.shape[0]):
                values.normal_(0.0, std, generator=generator(weight.device))
                weight.data[expert], scale.data[expert] = quantize_weight_block(values)

    def takes_fp8_rows(self, layer: nn.Module, hidden: torch.Tensor) -> bool:
        """Whether `apply` on hidden [T, H] runs W8A8 experts (the Triton kernels on a GPU with
        FP8 tensor cores, T from fused_moe_rule.W8A8_MIN_TOKENS) and so reads hidden's rows
        quantized per token-group of 128, written by the norm before."""
        if not (self._may_take_rows and hidden.is_cuda):
            return False
        return uses_fp8_activations(hidden.shape[0], device_properties(hidden.device))

    def apply(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k]
        x_fp8: Fp8GroupRows | None = None,
    ) -> torch.Tensor:
        """The kernels on CUDA tensors, the torch reference elsewhere; `x_fp8` (hidden's FP8
        rows) only where `takes_fp8_rows` said so."""
        w13, w2, s13, s2 = layer.w13, layer.w2, layer.w13_scale, layer.w2_scale
        if not hidden.is_cuda:
            return self._reference(
                hidden, w13, w2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2
            )
        rows = {} if x_fp8 is None else {"x_fp8": x_fp8}
        return self._kernel(
            hidden, w13, w2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2, **rows
        )
