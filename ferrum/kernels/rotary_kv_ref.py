"""Torch reference for neox-style rotary embedding with the optional Qwen3 per-head q/k RMSNorm.
cos / sin tables hold, per position p, cos(p * f_i) / sin(p * f_i) for i < rotary_dim / 2 with
f_i = base^(-2i / rotary_dim), fp32; a head x = [x1 | x2] rotates to
[x1 cos - x2 sin | x2 cos + x1 sin]."""

from __future__ import annotations

import torch

from ferrum.kernels.rms_norm_ref import rms_norm_ref


def compute_cos_sin(
    max_position: int, rotary_dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_position, rotary_dim // 2] fp32, of plain (unscaled) RoPE."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even and >= 2, got {rotary_dim}")
    if max_position < 1:
        raise ValueError(f"max_position must be >= 1, got {max_position}")
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return freqs.cos().float(), freqs.sin().float()


def rope_ref(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim], head_dim == rotary_dim
    cos: torch.Tensor,  # [num_tokens, head_dim // 2] fp32
    sin: torch.Tensor,  # [num_tokens, head_dim // 2] fp32
) -> torch.Tensor:
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the two halves, fp32, rounded once."""
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def qk_norm_rope_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [num_tokens, head_dim // 2] fp32
    sin: torch.Tensor,  # [num_tokens, head_dim // 2] fp32
    q_norm_weight: torch.Tensor | None = None,  # [head_dim]
    k_norm_weight: torch.Tensor | None = None,  # [head_dim]
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rope(norm(query)), rope(norm(key))); the norm is skipped when its weight is None."""
    if q_norm_weight is not None:
        query = rms_norm_ref(query, q_norm_weight, eps)
    if k_norm_weight is not None:
        key = rms_norm_ref(key, k_norm_weight, eps)
    return rope_ref(query, cos, sin), rope_ref(key, cos, sin)
