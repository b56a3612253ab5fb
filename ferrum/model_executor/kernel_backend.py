"""The kernel backend a model is built with (a `Kernels`): the torch references or the Triton
kernels. On the CPU the Triton kernels run in Triton's interpreter (slow, for tests), which must be
on before triton is first imported: `@triton.jit` reads TRITON_INTERPRET when it decorates."""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

from ferrum import envs
from ferrum.kernels.batch_invariant import batch_invariant_kernels
from ferrum.kernels.interface import Kernels, torch_kernels, triton_kernels
from ferrum.kernels.tuned_tables import set_user_config_dir

if TYPE_CHECKING:
    import torch

    from ferrum.config import DeviceConfig


def resolve_kernel_backend(device_config: DeviceConfig, device: torch.device) -> str:
    """The process's kernel backend: "auto" is Triton on CUDA and torch elsewhere; Triton on the
    CPU turns the interpreter on. Points the kernels' tile lookup at the tuned tables' folder
    (`tuned_config_dir`, else envs.tuned_config_dir())."""
    folder = device_config.tuned_config_dir
    set_user_config_dir(envs.tuned_config_dir() if folder is None else folder)
    kernel_backend = device_config.kernel_backend
    if kernel_backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if kernel_backend == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "kernel_backend: 'triton' needs the triton package (pip install triton)"
            )
        if device.type != "cuda":
            enable_triton_interpreter()
    return kernel_backend


def enable_triton_interpreter() -> None:
    """Makes Triton kernels run on the CPU; too late once triton is imported without it."""
    if "triton" in sys.modules and not envs.triton_interpret():
        raise ValueError(
            "kernel_backend: Triton kernels on the CPU need TRITON_INTERPRET=1 in the "
            "environment before triton is imported (set it when starting the process)"
        )
    envs.set_variable("TRITON_INTERPRET", "1")


def load_kernels(kernel_backend: str, batch_invariant: bool = False) -> Kernels:
    """The Triton launchers for backend "triton" (imports triton), the torch references for
    "torch"; with `batch_invariant`, their batch-invariant forms (kernels/batch_invariant.py)."""
    if kernel_backend == "torch":
        kernels = torch_kernels()
    elif kernel_backend == "triton":
        kernels = triton_kernels()
    else:
        raise ValueError(f"kernel_backend: must be 'torch' or 'triton', got {kernel_backend!r}")
    return batch_invariant_kernels(kernels) if batch_invariant else kernels
