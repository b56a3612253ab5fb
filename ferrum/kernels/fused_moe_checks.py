"""Input checks of the fused MoE launcher (`fused_moe`): shapes, dtypes, devices and layouts of the
activations, the stacked experts (and their FP8 block scales) and the routing."""

from __future__ import annotations

import torch

from ferrum.kernels import FLOAT_DTYPES

# Rows and columns of weight covered by one FP8 scale.
FP8_BLOCK = 128


def check_moe_inputs(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> None:
    """Raises ValueError naming the first argument that is not as `fused_moe` takes it."""
    if hidden.dim() != 2 or hidden.dtype not in FLOAT_DTYPES or hidden.stride(1) != 1:
        raise ValueError(
            f"hidden must be [num_tokens, hidden_size] fp16/bf16/fp32 with stride(1) == 1, got "
            f"{tuple(hidden.shape)} {hidden.dtype} strides {hidden.stride()}"
        )
    num_tokens, hidden_size = hidden.shape
    if w2.dim() != 3 or w2.shape[1] != hidden_size:
        raise ValueError(f"w2 must be [E, {hidden_size}, I], got {tuple(w2.shape)}")
    num_experts, _, inter = w2.shape
    fp8 = w13_scale is not None
    if fp8 != (w2_scale is not None):
        raise ValueError(
            "w13_scale and w2_scale must be given together (FP8 experts) or not at all"
        )
    if fp8 and (inter % FP8_BLOCK or hidden_size % FP8_BLOCK):
        raise ValueError(
            f"FP8 experts need hidden_size and intermediate_size multiples of {FP8_BLOCK}, got "
            f"{hidden_size} and {inter}"
        )
    weight_dtype = torch.float8_e4m3fn if fp8 else hidden.dtype
    for name, w, shape in (
        ("w13", w13, (num_experts, 2 * inter, hidden_size)),
        ("w2", w2, (num_experts, hidden_size, inter)),
    ):
        if tuple(w.shape) != shape or w.dtype != weight_dtype or not w.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous {list(shape)} {weight_dtype}, got "
                f"{tuple(w.shape)} {w.dtype} contiguous={w.is_contiguous()}"
            )
        scale = w13_scale if name == "w13" else w2_scale
        if scale is None:
            continue
        scale_shape = (num_experts, shape[1] // FP8_BLOCK, shape[2] // FP8_BLOCK)
        if tuple(scale.shape) != scale_shape or scale.dtype != torch.float32:
            raise ValueError(
                f"{name}_scale must be {list(scale_shape)} float32, got "
                f"{tuple(scale.shape)} {scale.dtype}"
            )
        if scale.stride(2) != 1 or scale.device != hidden.device:
            raise ValueError(f"{name}_scale must be on {hidden.device} with stride(2) == 1")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids must be [{num_tokens}, top_k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids dtype must be int32/int64, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(
            f"topk_weights must be float32 {list(topk_ids.shape)}, got "
            f"{tuple(topk_weights.shape)} {topk_weights.dtype}"
        )
    for name, t in (
        ("w13", w13),
        ("w2", w2),
        ("topk_weights", topk_weights),
        ("topk_ids", topk_ids),
    ):
        if t.device != hidden.device:
            raise ValueError(f"{name} must be on {hidden.device}, got {t.device}")
