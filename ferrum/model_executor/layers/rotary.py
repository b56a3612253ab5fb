"""Rotary position embedding, neox (rotate-half) style as in HF Llama/Qwen.

The cos/sin table is built once in float32 for positions [0, max_position) and shared by all
layers: the model looks positions up once per step and hands (cos, sin) to every attention layer.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept, the
    band between interpolated smoothly."""
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        if scaling.get(key) is None:
            raise ValueError(f"rope_parameters.{key}: required for rope_type 'llama3'")
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    if high_freq_factor <= low_freq_factor:
        raise ValueError(
            f"rope_parameters.high_freq_factor: must exceed low_freq_factor={low_freq_factor}, "
            f"got {high_freq_factor}"
        )
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Frequencies under `scaling["rope_type"]`: "linear" divides them all by `factor`
    (positions interpolated), "llama3" scales by wavelength."""
    if scaling["rope_type"] == "linear":
        factor = scaling.get("factor")
        if factor is None or float(factor) <= 0:
            raise ValueError(f"rope_parameters.factor: must be > 0 for 'linear', got {factor!r}")
        return inv_freq / float(factor)
    return _llama3_inv_freq(inv_freq, scaling)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"head_dim: rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)
        if scaling is not None:
            inv_freq = _scaled_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)  # [max_position, D/2]
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] int64 -> (cos, sin), each [num_tokens, head_dim // 2] float32."""
        return self.cos_cache[positions], self.sin_cache[positions]
