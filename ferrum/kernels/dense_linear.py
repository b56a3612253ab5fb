"""Linear layers in the model dtype on the Triton backend: out = x @ W^T (+ bias).

One activation row on a GPU runs the GEMV (gemv.py) with its tuned tile, or the rule's where no
table lists the shape (gemv_config.gemv_tile); a shape a table marks null (cuBLAS measured
faster) and everything else runs F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum.kernels.device_properties import device_properties
from ferrum.kernels.gemv import WEIGHT_DTYPES, gemv
from ferrum.kernels.gemv_config import GemvTile, gemv_tile


def gemv_tile_for(x: torch.Tensor, weight: torch.Tensor) -> GemvTile | None:
    """The GEMV's tile when x is one contiguous row on a GPU and the device's table does not
    mark W's shape for F.linear."""
    k = weight.shape[-1]
    if not x.is_cuda or x.numel() != k or x.shape[-1] != k or x.stride(-1) != 1:
        return None
    if x.dtype != weight.dtype:
        return None
    if weight.dtype not in WEIGHT_DTYPES or weight.dim() != 2 or weight.stride(1) != 1:
        return None
    device = device_properties(x.device)
    return None if device is None else gemv_tile(weight.shape[0], weight.shape[1], device)


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
