"""W8A8 FP8 linear layers: e4m3fn weights with fp32 scales, activations quantized dynamically (per
token-group of 128 for block scales, per token for per-channel). W[n, k] ~= weight[n, k] * scale,
scale `weight_scale_inv` / `weight_scale` [ceil(N / 128), K / 128] (block) or `weight_scale` [N, 1]
(channel); K % 128 == 0. Quantizing on load keeps `weight` in the model dtype until every shard is
in, then quantizes it in 128x128 blocks. On CUDA the layer's kernels run the product; elsewhere the
torch reference dequantizes and multiplies in fp32."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ferrum.kernels.batch_invariant import row_by_row
from ferrum.kernels.fp8_gemm_ref import fp8_linear_ref
from ferrum.kernels.fp8_quant import FP8_DTYPE, GROUP_SIZE, Fp8GroupRows
from ferrum.kernels.fp8_weight import (
    WEIGHT_BLOCK,
    quantize_weight_block,
    quantize_weight_per_channel,
)
from ferrum.kernels.interface import Kernels
from ferrum.model_executor.layers.linear import (
    new_parameter,
    quantized_parameter,
)
from ferrum.model_executor.layers.quantization.base import GeneratorFor
from ferrum.quant_config import QuantConfig


class Fp8LinearMethod:
    def __init__(self, quant_config: QuantConfig, kernels: Kernels, layer_name: str) -> None:
        """`layer_name` names the layer in errors."""
        self.layer_name = layer_name
        self.block = quant_config.weight_scales == "block"
        self.scale_name = quant_config.scale_name
        self.quantize_on_load = quant_config.quantize_on_load
        self._is_triton = kernels.is_triton
        self._gemm = kernels.fp8_block_linear if self.block else kernels.fp8_channel_linear
        self._takes_rows = kernels.fp8_block_linear_takes_rows
        reference = functools.partial(fp8_linear_ref, block_scales=self.block)
        self._reference = row_by_row(reference) if kernels.batch_invariant else reference

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        if input_size % GROUP_SIZE:
            raise ValueError(
                f"quantization: FP8 layer {self.layer_name} needs an input size that is a "
                f"multiple of {GROUP_SIZE} (the activation group), got {input_size}"
            )
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        if self._is_triton and device.type == "cuda" and dtype == torch.float32:
            raise ValueError(
                "dtype: FP8 layers compute in bfloat16 or float16 on CUDA, got float32"
            )
        if self.quantize_on_load:
            layer.weight = new_parameter(output_size, input_size)
            return
        layer.weight = quantized_parameter(torch.empty(output_size, input_size, dtype=FP8_DTYPE))
        if self.block:
            rows, cols = -(-output_size // WEIGHT_BLOCK[0]), input_size // WEIGHT_BLOCK[1]
            scale = quantized_parameter(
                torch.empty(rows, cols, dtype=torch.float32), WEIGHT_BLOCK[0]
            )
        else:
            scale = quantized_parameter(torch.empty(output_size, 1, dtype=torch.float32))
        setattr(layer, self.scale_name, scale)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.quantize_on_load or layer.weight.dtype == FP8_DTYPE:
            return
        weight, scale = quantize_weight_block(layer.weight.data)
        layer.weight = quantized_parameter(weight)
        setattr(layer, self.scale_name, quantized_parameter(scale, WEIGHT_BLOCK[0]))

    def fill_dummy_weights(self, layer: nn.Module, std: float, generator: GeneratorFor) -> None:
        if self.quantize_on_load:
            return  # `weight` is a model-dtype parameter until process_weights_after_loading
        weight = layer.weight
        values = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        values.normal_(0.0, std, generator=generator(weight.device))
        quantize = quantize_weight_block if self.block else quantize_weight_per_channel
        codes, scale = quantize(values)
        weight.data.copy_(codes)
        getattr(layer, self.scale_name).data.copy_(scale)

    def takes_fp8_rows(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Block-scaled layers on CUDA, at every bucket but the weight-only GEMV's
        (`block_linear_takes_fp8_rows`)."""
        if not self.block or not x.is_cuda or layer.weight.dtype != FP8_DTYPE:
            return False
        n, k = layer.weight.shape
        return self._takes_rows(x.device, x.dtype, n, k, x.numel() // k)

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        x_fp8: Fp8GroupRows | None = None,
    ) -> torch.Tensor:
        """`x_fp8` (x's rows quantized per token-group of 128) replaces the block GEMM's
        quantization pass; paths that quantize x another way ignore it (same values)."""
        scale = getattr(layer, self.scale_name)
        if x.is_cuda:
            if x_fp8 is not None and self.block:
                return self._gemm(x, layer.weight, scale, bias, x_fp8=x_fp8)
            return self._gemm(x, layer.weight, scale, bias)
        return self._reference(x, layer.weight, scale, bias)
