"""Torch reference of the W8A8 fused MoE (`fused_moe_w8a8`): FP8 experts (128x128 block scales)
times activations quantized per token-group of 128, in fp32 dequantized math. The hidden rows
and the SiLU-and-mul rows (rounded to hidden's dtype first) are quantized; each expert matmul
runs in fp32 on the dequantized operands and rounds to hidden's dtype (`fused_moe_fp8_ref`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferrum.kernels.fp8_quant_ref import (
    dequantize_per_token_group_ref,
    per_token_group_quant_fp8_ref,
)
from ferrum.kernels.fused_moe_ref import fused_moe_fp8_ref

# rows [n, K] -> (codes [n, K] fp8, scales [n, K / 128] fp32), as per_token_group_quant_fp8.
Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fused_moe_w8a8_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate_size, hidden_size] float8_e4m3fn
    w2: torch.Tensor,  # [num_experts, hidden_size, intermediate_size] float8_e4m3fn
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] integer expert ids
    w13_scale: torch.Tensor,  # [num_experts, 2 * intermediate_size / 128, hidden_size / 128]
    w2_scale: torch.Tensor,  # [num_experts, hidden_size / 128, intermediate_size / 128]
    quantize: Quantize = per_token_group_quant_fp8_ref,
) -> torch.Tensor:
    """[num_tokens, hidden_size] in hidden's dtype (module docstring). `quantize` makes the
    activation codes: torch's conversion by default; a test passes the Triton pass where the
    kernel's own conversion is not torch's (the CPU interpreter's fp32 -> fp8 cast)."""

    def fp8_rows(rows: torch.Tensor) -> torch.Tensor:
        return dequantize_per_token_group_ref(*quantize(rows.contiguous()))

    return fused_moe_fp8_ref(
        hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, fp8_rows=fp8_rows
    )
