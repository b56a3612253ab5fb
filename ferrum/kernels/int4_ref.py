"""INT4 weights in ferrum's layout, and the torch reference of the W4A16 product.

Layout (every checkpoint format is converted to it at load): `packed` int32 [N, K / 8], nibble i
(bits 4i..4i+3, unsigned 0..15) of word (n, j) is the code of weight (n, 8j + i); `scale`
[N, G] in the model dtype; `zero` uint8 [N, G] (None: 8, symmetric); `g_idx` int32 [K] (None:
k // group_size), the group of input column k. Weight (n, k) = (code - zero[n, g]) * scale[n, g]
with g = g_idx[k]."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

NIBBLES = 8  # codes per int32 word
SYMMETRIC_ZERO = 8


def unpack_int4(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[..., W] int32 -> [..., 8W] int32 codes 0..15 along the last dim: nibble i of a word is
    code i, or code order[i] of its 8 (a format that interleaves them)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    codes = (packed[..., None] >> shifts) & 0xF  # [..., W, 8], nibble i at i
    if order is not None:
        codes = codes[..., list(_inverse(order))]
    return codes.reshape(*packed.shape[:-1], -1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[..., 8W] codes 0..15 -> [..., W] int32, code i of each 8 in nibble i."""
    if codes.shape[-1] % NIBBLES:
        raise ValueError(f"pack_int4: the last dim ({codes.shape[-1]}) must be a multiple of 8")
    grouped = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, NIBBLES)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (grouped << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    """Nibble i holds code order[i]: the nibble of each code."""
    inverse = [0] * len(order)
    for nibble, code in enumerate(order):
        inverse[code] = nibble
    return tuple(inverse)


def group_index(k: int, group_size: int, g_idx: torch.Tensor | None, device: torch.device):  # noqa: ANN201
    return g_idx.long() if g_idx is not None else torch.arange(k, device=device) // group_size


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
) -> torch.Tensor:
    """[N, K] float32 weights (module docstring)."""
    codes = unpack_int4(packed).float()
    groups = group_index(codes.shape[1], group_size, g_idx, packed.device)
    zeros = SYMMETRIC_ZERO if zero is None else zero.float()[:, groups]
    return (codes - zeros) * scale.float()[:, groups]


def int4_linear_ref(
    x: torch.Tensor,  # [..., K]
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    linear: Callable[..., torch.Tensor] = F.linear,
) -> torch.Tensor:
    """[..., N] in x's dtype: x @ dequantize_int4(...)^T (the weights rounded to x's dtype, the
    product in x's dtype, as the kernel's tensor-core tiles), the product by `linear`."""
    weight = dequantize_int4(packed, scale, zero, g_idx, group_size).to(x.dtype)
    return linear(x, weight, bias)
