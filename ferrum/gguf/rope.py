"""RoPE scaling of a GGUF file: `{arch}.rope.scaling.*` metadata, or Llama 3's `rope_freqs`
tensor (per-frequency divisors that llama.cpp's converter computes from the llama3 parameters),
turned back into config.json's `rope_scaling`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ferrum.gguf.reader import GGUFFile

ROPE_FREQS = "rope_freqs.weight"
# The llama3 frequency factors of every Llama 3.1 / 3.2 / 3.3 release; the scaling factor and
# the original context length are read back from the divisors.
_LOW_FREQ_FACTOR = 1.0
_HIGH_FREQ_FACTOR = 4.0
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
    original = _llama3_original_context(divisors, theta, head_dim, factor)
    if original is None:
        raise ValueError(
            f"GGUF file {file.path}: tensor {ROPE_FREQS} is not Llama 3's RoPE scaling (low/high "
            f"frequency factors {_LOW_FREQ_FACTOR}/{_HIGH_FREQ_FACTOR}); other per-frequency "
            "factors are not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": _LOW_FREQ_FACTOR,
        "high_freq_factor": _HIGH_FREQ_FACTOR,
        "original_max_position_embeddings": original,
    }


def _llama3_original_context(
    divisors: np.ndarray, theta: float, head_dim: int, factor: float
) -> int | None:
    """The original context length whose llama3 divisors are `divisors`: solved from a divisor
    of the blended band when there is one, else the first power of two that reproduces them."""
    candidates = []
    for i, divisor in enumerate(divisors):
        if 1.0 + _TOLERANCE < divisor < factor * (1.0 - _TOLERANCE):
            smooth = (1.0 / divisor - 1.0 / factor) / (1.0 - 1.0 / factor)
            wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
            band = smooth * (_HIGH_FREQ_FACTOR - _LOW_FREQ_FACTOR) + _LOW_FREQ_FACTOR
            candidates.append(round(wavelen * band))
    candidates += [2**k for k in range(4, 25)]
    for original in candidates:
        expected = llama3_divisors(
            theta, head_dim, factor, _LOW_FREQ_FACTOR, _HIGH_FREQ_FACTOR, original
        )
        if np.allclose(divisors, expected, rtol=_TOLERANCE, atol=0.0):
            return original
    return None
