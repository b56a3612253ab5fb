"""Chooses between the torch reference ops and the Triton kernels for a loaded model.

Layers with a Triton path define `use_triton_kernels()`; this module calls it on each of them.
On the CPU the Triton kernels run in Triton's interpreter (slow, for tests), which must be turned
on before triton is first imported: `@triton.jit` (triton's own `tl.sum` too) reads
TRITON_INTERPRET when it decorates.
"""

from __future__ import annotations

import importlib.util
import sys

import torch
from torch import nn

from ferrum import envs


def resolve_kernel_backend(kernel_backend: str, device: torch.device) -> str:
    """ "auto" is Triton on CUDA and torch elsewhere."""
    if kernel_backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return kernel_backend


def apply_kernel_backend(model: nn.Module, kernel_backend: str, device: torch.device) -> str:
    """Switches every layer with a Triton path to it when the backend is triton; returns it."""
    backend = resolve_kernel_backend(kernel_backend, device)
    if backend != "triton":
        return backend
    if importlib.util.find_spec("triton") is None:
        raise ValueError("kernel_backend: 'triton' needs the triton package (pip install triton)")
    if device.type != "cuda":
        if "triton" in sys.modules and not envs.triton_interpret():
            raise ValueError(
                "kernel_backend: Triton kernels on the CPU need TRITON_INTERPRET=1 in the "
                "environment before triton is imported (set it when starting the process)"
            )
        envs.enable_triton_interpreter()
    for module in model.modules():
        if hasattr(module, "use_triton_kernels"):
            module.use_triton_kernels()
    return backend
