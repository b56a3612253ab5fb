"""FP8 linear: out = x @ W^T (+ bias) for an FP8 weight, the GEMM picked per batch size.

x [..., K] fp16/bf16 is quantized dynamically (per token-group of 128 for block-scaled weights,
per token for per-channel weights) and the output has x's dtype. The buckets (fp8_gemm_config)
choose, per number of rows M: the fused Triton GEMM (quantizes its own activation tiles), a
quantization pass then the Triton GEMM, or (per-channel only) a quantization pass then
torch._scaled_mm. scaled_mm runs only where cuBLASLt's row-wise scaling takes the operands (bf16
output, N and K multiples of 16); elsewhere that bucket's Triton tile runs instead.
"""

from __future__ import annotations

import torch

from ferrum.kernels.fp8_gemm import w8a8_block_fp8_matmul, w8a8_channel_fp8_matmul
from ferrum.kernels.fp8_gemm_config import DEFAULT_BUCKETS, Buckets, pick
from ferrum.kernels.fp8_quant import per_token_group_quant_fp8, per_token_quant_fp8

_ACT_DTYPES = (torch.float16, torch.bfloat16)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype not in _ACT_DTYPES or x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}] fp16/bf16, got {list(x.shape)} {x.dtype}")
    return x.reshape(-1, k)


def fp8_block_linear(
    x: torch.Tensor,  # [..., K] fp16/bf16
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale_inv: torch.Tensor,  # [ceil(N / 128), K / 128] fp32
    bias: torch.Tensor | None = None,  # [N]
    buckets: Buckets | None = None,
) -> torch.Tensor:
    """Returns [..., N] in x's dtype: x quantized per token-group of 128, block-scaled GEMM."""
    n, k = weight.shape
    x2 = _rows(x, k)
    config = pick(DEFAULT_BUCKETS["block"] if buckets is None else buckets, x2.shape[0])
    if config.quant == "fused":
        out = w8a8_block_fp8_matmul(x2, weight, weight_scale_inv, x.dtype, config, bias=bias)
    else:
        q, scales = per_token_group_quant_fp8(x2)
        out = w8a8_block_fp8_matmul(
            q, weight, weight_scale_inv, x.dtype, config, a_scale=scales, bias=bias
        )
    return out.view(*x.shape[:-1], n)


def scaled_mm_takes(out_dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether torch._scaled_mm's row-wise scaled path serves this GEMM (see module docstring)."""
    return out_dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def fp8_channel_linear(
    x: torch.Tensor,  # [..., K] fp16/bf16
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N, 1] fp32
    bias: torch.Tensor | None = None,  # [N]
    buckets: Buckets | None = None,
) -> torch.Tensor:
    """Returns [..., N] in x's dtype: x quantized per token, per-channel scaled GEMM."""
    n, k = weight.shape
    x2 = _rows(x, k)
    config = pick(DEFAULT_BUCKETS["channel"] if buckets is None else buckets, x2.shape[0])
    if weight_scale.shape != (n, 1) or weight_scale.dtype != torch.float32:
        raise ValueError(
            f"weight_scale must be [{n}, 1] float32, got {list(weight_scale.shape)} "
            f"{weight_scale.dtype}"
        )
    if config.backend == "scaled_mm" and scaled_mm_takes(x.dtype, n, k):
        q, scales = per_token_quant_fp8(x2)
        out = torch._scaled_mm(
            q, weight.t(), scale_a=scales, scale_b=weight_scale.view(1, n), out_dtype=x.dtype
        )
        if bias is not None:
            out += bias
    elif config.quant == "fused":
        out = w8a8_channel_fp8_matmul(x2, weight, weight_scale, x.dtype, config, bias=bias)
    else:
        q, scales = per_token_quant_fp8(x2)
        out = w8a8_channel_fp8_matmul(
            q, weight, weight_scale, x.dtype, config, a_scale=scales, bias=bias
        )
    return out.view(*x.shape[:-1], n)
