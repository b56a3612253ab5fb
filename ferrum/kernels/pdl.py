"""Programmatic dependent launch (PDL): on Hopper and later a kernel starts while the kernel before
it in the stream is still finishing.

A kernel launched with PDL (`**pdl_launch_args(device)`) may start once every program of the
kernel before it has called `pdl_launch_dependents` (or exited). Its `pdl_wait` returns once that
kernel has finished and its writes are visible. The kernels a decode step chains (norms, GEMVs,
RoPE/KV write, split-KV attention, SiLU-and-mul, the MoE router and small-batch experts) launch
this way wherever they run, so a step's kernels start early and wait on the device instead of
paying each launch and ramp-up in turn. A GEMV loads its first weight tile before the wait,
overlapping the previous kernel's tail.

Invariants of a kernel launched with PDL:
- Before `pdl_wait` it reads only what no kernel writes while serving (weights, scales) and
  writes nothing.
- Every program calls `pdl_wait`, also one with nothing to do. A kernel whose programs all
  skipped the wait could finish before the kernel it follows. The kernel after it would then
  read too soon: its own wait only covers its immediate predecessor.

Kernels call `pdl_launch_dependents` first, so the next kernel is queued as soon as this one's
last program has started; its programs take free slots and wait there.
Off the GPU (Triton's interpreter), before sm90, on ROCm, with a Triton that lacks griddepcontrol
(`triton.language.extra.cuda.gdc_wait`), and with FERRUM_DEBUG_NO_PDL=1 (an A/B switch), kernels
launch plainly and both calls compile to nothing.
"""

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
