"""Torch references for the FP8 GEMMs: W8A8 (dequantize both operands to fp32, then matmul), also
with the fp8_linear launchers' signatures, and the weight-only product of the one-row GEMV (the
activations as given)."""

from __future__ import annotations

import torch

from ferrum.kernels.fp8_quant import FP8_DTYPE
from ferrum.kernels.fp8_quant_ref import (
    dequantize_per_token_group_ref,
    per_token_group_quant_fp8_ref,
    per_token_quant_fp8_ref,
)
from ferrum.kernels.fp8_weight import dequantize_weight_block, dequantize_weight_per_channel


def _finish(
    a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    out = a @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def w8a8_block_fp8_matmul_ref(
    a: torch.Tensor,  # [M, K] fp8 with a_scale, or float (quantized per group of 128)
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale_inv: torch.Tensor,  # [ceil(N / 128), K / 128] fp32
    out_dtype: torch.dtype,
    a_scale: torch.Tensor | None = None,  # [M, K / 128] fp32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """(dequant(a) @ dequant(weight)^T + bias).to(out_dtype), computed in fp32."""
    if a.dtype != FP8_DTYPE:
        a, a_scale = per_token_group_quant_fp8_ref(a)
    a_f = dequantize_per_token_group_ref(a, a_scale)
    return _finish(a_f, dequantize_weight_block(weight, weight_scale_inv), bias, out_dtype)


def fp8_weight_only_matmul_ref(
    a: torch.Tensor,  # [M, K] fp16/bf16/fp32
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [ceil(N / 128), K / 128] (block_scales) or [N, 1] fp32
    block_scales: bool,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """(a @ dequant(weight)^T + bias).to(out_dtype), computed in fp32 (fp8_gemv's product)."""
    dequantize = dequantize_weight_block if block_scales else dequantize_weight_per_channel
    return _finish(a.float(), dequantize(weight, weight_scale), bias, out_dtype)


def w8a8_channel_fp8_matmul_ref(
    a: torch.Tensor,  # [M, K] fp8 with a_scale, or float (quantized per token)
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N, 1] fp32
    out_dtype: torch.dtype,
    a_scale: torch.Tensor | None = None,  # [M, 1] fp32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """(dequant(a) @ dequant(weight)^T + bias).to(out_dtype), computed in fp32."""
    if a.dtype != FP8_DTYPE:
        a, a_scale = per_token_quant_fp8_ref(a)
    a_f = dequantize_per_token_group_ref(a, a_scale)
    return _finish(a_f, dequantize_weight_per_channel(weight, weight_scale), bias, out_dtype)


def fp8_linear_ref(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [ceil(N / 128), K / 128] (block_scales) or [N, 1] fp32
    bias: torch.Tensor | None = None,  # [N]
    *,
    block_scales: bool,
) -> torch.Tensor:
    """The W8A8 reference with the fp8_linear launchers' signature: [..., N] in x's dtype."""
    matmul = w8a8_block_fp8_matmul_ref if block_scales else w8a8_channel_fp8_matmul_ref
    out = matmul(x.reshape(-1, x.shape[-1]), weight, weight_scale, x.dtype, bias=bias)
    return out.view(*x.shape[:-1], out.shape[-1])
