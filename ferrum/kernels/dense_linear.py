"""Linear layers in the model dtype on the Triton backend: out = x @ W^T (+ bias).

One activation row on a GPU whose tile table (gemv_config) lists the weight's shape runs the
GEMV (gemv.py), which was measured faster than cuBLAS there; everything else runs F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum.kernels import cuda_device_name
from ferrum.kernels.gemv import WEIGHT_DTYPES, gemv
from ferrum.kernels.gemv_config import GemvTile, get_gemv_tiles


def gemv_tile_for(x: torch.Tensor, weight: torch.Tensor) -> GemvTile | None:
    """The GEMV's tile when x is one contiguous row on a GPU and W's shape is in the device's
    table."""
    k = weight.shape[-1]
    if not x.is_cuda or x.numel() != k or x.shape[-1] != k or x.stride(-1) != 1:
        return None
    if x.dtype != weight.dtype:
        return None
    if weight.dtype not in WEIGHT_DTYPES or weight.dim() != 2 or weight.stride(1) != 1:
        return None
    tiles = get_gemv_tiles(cuda_device_name(x.device))
    return tiles.get((weight.shape[0], weight.shape[1]))


def dense_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """[..., N] in x's dtype."""
    tile = gemv_tile_for(x, weight)
    if tile is None:
        return F.linear(x, weight, bias)
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
