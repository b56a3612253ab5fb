"""Linear layers in the model dtype on the Triton backend: out = x @ W^T (+ bias).

One activation row on a GPU runs the GEMV (gemv.py) with its tuned tile, or the rule's where no
table lists the shape (gemv_config.gemv_tile); 2..MAX_ROWS rows (a verify step's, a small
batch's) run the few-row kernel (gemv_rows.py) where a tuned table lists the shape at that row
bucket (gemv_rows_config: no rule, cuBLAS is the default there); a shape a table marks null
(cuBLAS measured faster) and everything else runs F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum.kernels.device_properties import device_properties
from ferrum.kernels.gemv import WEIGHT_DTYPES, gemv
from ferrum.kernels.gemv_config import GemvTile, gemv_tile
from ferrum.kernels.gemv_rows import MAX_ROWS, GemvRowsTile, gemv_rows
from ferrum.kernels.gemv_rows_config import gemv_rows_tile


def _triton_operands(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x's rows contiguous on a GPU in W's fp16/bf16 dtype, W [N, K] with stride(1) == 1."""
    k = weight.shape[-1]
    if not x.is_cuda or x.shape[-1] != k or x.stride(-1) != 1 or x.dtype != weight.dtype:
        return False
    return weight.dtype in WEIGHT_DTYPES and weight.dim() == 2 and weight.stride(1) == 1


def gemv_tile_for(x: torch.Tensor, weight: torch.Tensor) -> GemvTile | None:
    """The GEMV's tile when x is one contiguous row on a GPU and the device's table does not
    mark W's shape for F.linear."""
    if x.numel() != weight.shape[-1] or not _triton_operands(x, weight):
        return None
    device = device_properties(x.device)
    return None if device is None else gemv_tile(weight.shape[0], weight.shape[1], device)


def gemv_rows_tile_for(x: torch.Tensor, weight: torch.Tensor) -> GemvRowsTile | None:
    """The few-row kernel's tile when x is 2..MAX_ROWS rows on a GPU and the device's table
    lists W's shape at that row bucket."""
    rows = x.numel() // max(1, weight.shape[-1])
    if not 2 <= rows <= MAX_ROWS or not _triton_operands(x, weight):
        return None
    device = device_properties(x.device)
    if device is None:
        return None
    return gemv_rows_tile(weight.shape[0], weight.shape[1], rows, device)


def dense_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """[..., N] in x's dtype."""
    tile = gemv_tile_for(x, weight)
    if tile is not None:
        out = gemv(
            x.reshape(1, -1),
            weight,
            tile.BLOCK_N,
            tile.BLOCK_K,
            tile.num_warps,
            tile.num_stages,
            bias=bias,
        )
        return out.view(*x.shape[:-1], weight.shape[0])
    rows_tile = gemv_rows_tile_for(x, weight)
    if rows_tile is None:
        return F.linear(x, weight, bias)
    out = gemv_rows(x.reshape(-1, weight.shape[-1]), weight, rows_tile, bias)
    return out.view(*x.shape[:-1], weight.shape[0])
