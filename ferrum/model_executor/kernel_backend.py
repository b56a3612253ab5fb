"""The kernel backend a model is built with: the torch references or the Triton kernels.

Layers take a `TritonKernels | None` at construction (None runs the `kernels/*_ref.py` torch
references). On the CPU the Triton kernels run in Triton's interpreter (slow, for tests), which
must be on before triton is first imported: `@triton.jit` reads TRITON_INTERPRET when it decorates.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ferrum import envs

if TYPE_CHECKING:
    import torch

    from ferrum.kernels.fp8_quant import Fp8GroupRows


@dataclass(frozen=True, slots=True)
class TritonKernels:
    """The Triton launchers the layers call (see each one's signature in ferrum/kernels/)."""

    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., None]
    rms_norm_fp8: Callable[..., tuple[torch.Tensor, Fp8GroupRows]]
    fused_add_rms_norm_fp8: Callable[..., Fp8GroupRows]
    silu_and_mul: Callable[..., torch.Tensor]
    silu_and_mul_fp8: Callable[..., tuple[torch.Tensor, Fp8GroupRows]]
    rotary_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    moe_router: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    fused_moe: Callable[..., torch.Tensor]
    dense_linear: Callable[..., torch.Tensor]
    fp8_block_linear: Callable[..., torch.Tensor]
    fp8_block_linear_takes_rows: Callable[..., bool]
    fp8_channel_linear: Callable[..., torch.Tensor]
    causal_conv1d_prefill: Callable[..., torch.Tensor]
    causal_conv1d_update: Callable[..., torch.Tensor]
    gated_delta_rule_prefill: Callable[..., torch.Tensor]
    gated_delta_rule_decode: Callable[..., torch.Tensor]


def resolve_kernel_backend(kernel_backend: str, device: torch.device) -> str:
    """ "auto" is Triton on CUDA and torch elsewhere; Triton on the CPU turns the interpreter on."""
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
    os.environ["TRITON_INTERPRET"] = "1"


def load_kernels(kernel_backend: str) -> TritonKernels | None:
    """The Triton kernels for backend "triton" (imports triton), None for "torch"."""
    if kernel_backend == "torch":
        return None
    if kernel_backend != "triton":
        raise ValueError(f"kernel_backend: must be 'torch' or 'triton', got {kernel_backend!r}")
    from ferrum.kernels import activation, fused_moe, moe_router, paged_attention, rms_norm
    from ferrum.kernels.causal_conv1d import causal_conv1d_prefill, causal_conv1d_update
    from ferrum.kernels.dense_linear import dense_linear
    from ferrum.kernels.fp8_linear import (
        block_linear_takes_fp8_rows,
        fp8_block_linear,
        fp8_channel_linear,
    )
    from ferrum.kernels.gated_delta_rule_decode import gated_delta_rule_decode
    from ferrum.kernels.gated_delta_rule_prefill import gated_delta_rule_prefill
    from ferrum.kernels.rotary_kv import rotary_kv

    return TritonKernels(
        rms_norm=rms_norm.rms_norm,
        fused_add_rms_norm=rms_norm.fused_add_rms_norm,
        rms_norm_fp8=rms_norm.rms_norm_fp8,
        fused_add_rms_norm_fp8=rms_norm.fused_add_rms_norm_fp8,
        silu_and_mul=activation.silu_and_mul,
        silu_and_mul_fp8=activation.silu_and_mul_fp8,
        rotary_kv=rotary_kv,
        paged_attention=paged_attention.paged_attention,
        moe_router=moe_router.moe_router,
        fused_moe=fused_moe.fused_moe,
        dense_linear=dense_linear,
        fp8_block_linear=fp8_block_linear,
        fp8_block_linear_takes_rows=block_linear_takes_fp8_rows,
        fp8_channel_linear=fp8_channel_linear,
        causal_conv1d_prefill=causal_conv1d_prefill,
        causal_conv1d_update=causal_conv1d_update,
        gated_delta_rule_prefill=gated_delta_rule_prefill,
        gated_delta_rule_decode=gated_delta_rule_decode,
    )
