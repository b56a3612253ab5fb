"""Torch reference for the gated SiLU activation of SwiGLU MLPs (Hugging Face rounding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [..., 2 * inter] -> [..., inter]
    """silu(gate) * up with gate = x[..., :inter], up = x[..., inter:], each op in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
