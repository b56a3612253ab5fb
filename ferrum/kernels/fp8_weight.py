"""FP8 (e4m3fn) weight (de)quantization at load time, in plain torch (once per weight). Layouts of
W [N, K]: block (Qwen, DeepSeek): `weight_scale_inv` [ceil(N / 128), ceil(K / 128)],
W[n, k] ~= weight[n, k] * scale_inv[n // 128, k // 128], edge blocks partial; per channel
(compressed-tensors): `weight_scale` [N, 1]. Quantizing maps each block's (or row's) abs-max to
FP8_MAX; an all-zero block gets a tiny scale."""

from __future__ import annotations

import torch

from ferrum.kernels.fp8_quant import AMAX_FLOOR, FP8_DTYPE, FP8_MAX

WEIGHT_BLOCK = (128, 128)


def _check_weight(weight: torch.Tensor, float_only: bool) -> None:
    allowed = (torch.float16, torch.bfloat16, torch.float32) + (() if float_only else (FP8_DTYPE,))
    if weight.dim() != 2 or weight.dtype not in allowed or 0 in weight.shape:
        names = "fp16/bf16/fp32" + ("" if float_only else "/float8_e4m3fn")
        raise ValueError(
            f"weight must be a non-empty 2-D [N, K] {names} tensor, got {tuple(weight.shape)} "
            f"{weight.dtype}"
        )


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or not all(type(b) is int and b >= 1 for b in block):
        raise ValueError(f"block must be two positive ints (bn, bk), got {block!r}")
    return block


def _block_scale_shape(shape: torch.Size, block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _expand_blocks(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int]) -> torch.Tensor:
    """scale [ceil(N / bn), ceil(K / bk)] -> [N, K], each entry repeated over its block."""
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


def quantize_weight_block(
    weight: torch.Tensor,  # [N, K] fp16/bf16/fp32
    block: tuple[int, int] = WEIGHT_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (fp8 [N, K], scale_inv fp32 [ceil(N / bn), ceil(K / bk)]), one scale per block."""
    _check_weight(weight, float_only=True)
    bn, bk = _check_block(block)
    n, k = weight.shape
    rows, cols = _block_scale_shape(weight.shape, block)
    padded = torch.zeros(rows * bn, cols * bk, dtype=torch.float32, device=weight.device)
    padded[:n, :k] = weight
    tiles = padded.view(rows, bn, cols, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale


def dequantize_weight_block(
    weight: torch.Tensor,  # [N, K] fp8
    scale_inv: torch.Tensor,  # [ceil(N / bn), ceil(K / bk)] fp32
    block: tuple[int, int] = WEIGHT_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Returns (weight * scale_inv per block).to(dtype), [N, K]."""
    _check_weight(weight, float_only=False)
    _check_block(block)
    expected = _block_scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv must be {list(expected)} for weight {list(weight.shape)} and block "
            f"{list(block)}, got {list(scale_inv.shape)}"
        )
    full = _expand_blocks(scale_inv.float(), weight.shape, block)
    return (weight.float() * full).to(dtype)


def quantize_weight_per_channel(
    weight: torch.Tensor,  # [N, K] fp16/bf16/fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (fp8 [N, K], scale fp32 [N, 1]), one scale per output row."""
    _check_weight(weight, float_only=True)
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=AMAX_FLOOR) / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_weight_per_channel(
    weight: torch.Tensor,  # [N, K] fp8
    scale: torch.Tensor,  # [N, 1] fp32 (or [N])
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Returns (weight * scale[n]).to(dtype), [N, K]."""
    _check_weight(weight, float_only=False)
    if scale.numel() != weight.shape[0] or scale.dim() not in (1, 2):
        raise ValueError(
            f"scale must be [{weight.shape[0]}, 1] or [{weight.shape[0]}], got {list(scale.shape)}"
        )
    return (weight.float() * scale.float().reshape(-1, 1)).to(dtype)
