"""Triton kernels, one op per module, each beside its torch reference (`*_ref.py`)."""

import functools

import torch

# Activation dtypes every launcher accepts.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# KV cache dtypes the cache writers and attention kernels accept: the activation dtypes, or FP8
# (e4m3, per-tensor scale 1.0: values are saturated to +-448 when written).
FP8_KV_DTYPE = torch.float8_e4m3fn
KV_CACHE_DTYPES = (*FLOAT_DTYPES, FP8_KV_DTYPE)


@functools.cache
def cuda_device_name(device: torch.device) -> str | None:
    """The GPU's name, which keys the tuned-config files (spaces become underscores there);
    None off CUDA."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


@functools.cache
def cuda_capability(device_index: int | None) -> tuple[int, int]:
    """The GPU's compute capability (major, minor); None is the current device."""
    return torch.cuda.get_device_capability(device_index)
