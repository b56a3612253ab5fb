"""The kernel backend a model is built with (a `Kernels`): the torch references or the Triton
kernels, and the attention backend its layers take for long chunks (`attach_flash_attention`).
On the CPU the Triton kernels run in Triton's interpreter (slow, for tests), which must be on
before triton is first imported: `@triton.jit` reads TRITON_INTERPRET when it decorates."""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

from ferrum import envs
from ferrum.config_fields import field_error
from ferrum.kernels.batch_invariant import batch_invariant_kernels
from ferrum.kernels.flash_attn4 import FA4_MIN_PAIRS
from ferrum.kernels.interface import Kernels, torch_kernels, triton_kernels
from ferrum.kernels.tuned_tables import set_user_config_dir
from ferrum.logger import init_logger

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ferrum.device_config import DeviceConfig

logger = init_logger(__name__)


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


def attach_flash_attention(
    model: nn.Module,
    device_config: DeviceConfig,
    device: torch.device,
    kernel_backend: str,
    dtype: torch.dtype,
    kv_cache_dtype: torch.dtype,
) -> bool:
    """Gives FlashAttention-4 (`kernels/flash_attn4.py`) to every attention layer it takes under
    `attention_backend`: "auto" where the package is installed, with the Triton kernels on a GPU
    and a layer shape it runs (else ferrum's kernels, said once in the log); "FLASH_ATTN" the
    same, but a reason it cannot run is an error naming the field; "TRITON_ATTN" never.
    Returns whether any layer took it."""
    import torch

    from ferrum.kernels.flash_attn4 import (
        NOT_INSTALLED,
        FlashAttention4,
        flash_attn4_rejects,
        load_flash_attn4,
    )
    from ferrum.model_executor.layers.attention import Attention

    backend = device_config.attention_backend
    if backend == "TRITON_ATTN":
        return False
    required = backend == "FLASH_ATTN"
    reason = None
    if device.type != "cuda" or kernel_backend != "triton":
        reason = "needs a CUDA device with the Triton kernel backend"
    elif device_config.batch_invariant:
        reason = "is not batch-invariant (batch_invariant is on)"
    varlen_func, tried = None, reason is None
    if tried:
        varlen_func, why_not = load_flash_attn4()
        reason = why_not or None
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if reason is None:
        capability = torch.cuda.get_device_capability(device)
        rejects = (
            flash_attn4_rejects(capability, dtype, kv_cache_dtype, m.head_dim) for m in layers
        )
        reason = next((r for r in rejects if r is not None), None)
    if reason is not None:
        if required:
            raise field_error("attention_backend", f"'FLASH_ATTN' (FlashAttention-4) {reason}")
        if backend == "auto" and tried and reason != NOT_INSTALLED:
            logger.warning("attention: ferrum's kernels; FlashAttention-4 %s", reason)
        return False
    assert varlen_func is not None
    flash_attention = FlashAttention4(varlen_func)
    for layer in layers:
        layer.use_flash_attention(flash_attention)
    logger.info(
        "attention: FlashAttention-4 for steps whose prompt chunks attend over at least %d "
        "(query, key) pairs",
        FA4_MIN_PAIRS,
    )
    return True
