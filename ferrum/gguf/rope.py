"""RoPE scaling of a GGUF file: `{arch}.rope.scaling.*` metadata, or Llama 3's `rope_freqs`
tensor (per-frequency divisors that llama.cpp's converter computes from the llama3 parameters),
turned back into config.json's `rope_scaling`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ferrum.gguf.reader import GGUFFile

ROPE_FREQS = "rope_freqs.weight"
# The llama3 parameters of every Llama 3.1 / 3.2 / 3.3 release (the factor is read from the file).
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192
_TOLERANCE = 1e-3


def llama3_divisors(
    theta: float, head_dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """How much llama3 scaling divides each rotary frequency: 1 for short wavelengths, `factor`
    for long ones, a smooth blend between `original / high` and `original / low`."""
    divisors = []
    for i in range(head_dim // 2):
        wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelen < original / high:
            divisors.append(1.0)
        elif wavelen > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float64)


def rope_scaling_of(
    file: GGUFFile, arch: str, theta: float, head_dim: int
) -> dict[str, Any] | None:
    """config.json's `rope_scaling` (None for plain RoPE); kinds ferrum lacks are refused."""
    kind = file.field(f"{arch}.rope.scaling.type", str, "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": file.field(f"{arch}.rope.scaling.factor", float)}
    if kind != "none":
        raise ValueError(
            f"GGUF file {file.path}: {arch}.rope.scaling.type {kind!r} is not supported; "
            "supported: none, linear, and Llama 3's rope_freqs"
        )
    tensor = next((t for t in file.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    divisors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    if tensor.tensor_type.name != "F32" or divisors.size != head_dim // 2:
        raise ValueError(
            f"GGUF file {file.path}: tensor {ROPE_FREQS} must hold {head_dim // 2} F32 values"
        )
    factor = float(divisors.max())
    params = (_LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR, _LLAMA3_ORIGINAL_CONTEXT)
    expected = llama3_divisors(theta, head_dim, factor, *params)
    if not np.allclose(divisors, expected, rtol=_TOLERANCE, atol=0.0):
        raise ValueError(
            f"GGUF file {file.path}: tensor {ROPE_FREQS} is not Llama 3's RoPE scaling (low/high "
            f"frequency factors {params[0]}/{params[1]}, original context {params[2]}); other "
            "per-frequency factors are not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": params[0],
        "high_freq_factor": params[1],
        "original_max_position_embeddings": params[2],
    }
