"""Programmatic dependent launch (PDL, sm90+): a kernel launched with `**pdl_launch_args(device)`
may start once every program of the one before it called `pdl_launch_dependents` (or exited); its
`pdl_wait` returns once that kernel finished and its writes are visible. A decode step's kernels
launch so (calling `pdl_launch_dependents` first) and wait on the device instead of paying each
launch in turn. Invariants: before `pdl_wait` a kernel reads only what no serving kernel writes
(weights, scales) and writes nothing; every program calls `pdl_wait`, even an idle one (else the
kernel could finish before its predecessor, whose writes the next kernel's wait does not cover).
Off sm90+ CUDA, without Triton's gdc_wait or with FERRUM_DEBUG_NO_PDL=1 both calls are no-ops."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ferrum import envs
from ferrum.kernels import cuda_capability

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    TRITON_HAS_PDL = True
except ImportError:  # a Triton without griddepcontrol: kernels launch plainly
    TRITON_HAS_PDL = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


# Programmatic dependent launch needs Hopper's griddepcontrol instructions (NVIDIA only).
MIN_PDL_CAPABILITY = (9, 0)


@functools.cache
def _device_takes_pdl(device_index: int | None) -> bool:
    return (
        TRITON_HAS_PDL
        and torch.version.hip is None
        and cuda_capability(device_index) >= MIN_PDL_CAPABILITY
        and not envs.debug_no_pdl()
    )


def uses_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: an NVIDIA GPU of sm90 or later and a Triton
    with griddepcontrol, unless FERRUM_DEBUG_NO_PDL=1."""
    return device.type == "cuda" and _device_takes_pdl(device.index)


def pdl_launch_args(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a kernel that takes USE_PDL, on `device`: USE_PDL, and with it
    `launch_pdl` (only when on, so a Triton that predates the option never sees it)."""
    if uses_pdl(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Lets the next kernel start once every program of this one has called this."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Returns once the kernel before this one has finished and its writes are visible."""
    if USE_PDL:
        gdc_wait()
