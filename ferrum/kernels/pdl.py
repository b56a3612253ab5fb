"""Programmatic dependent launch (PDL): on Hopper and later a kernel starts while the kernel before
it in the stream is still finishing.

A kernel launched with `launch_pdl=True` may start once every program of the kernel before it
has called `pdl_launch_dependents` (or exited). Its `pdl_wait` returns once that kernel has
finished and its writes are visible. The decode path's kernels launch this way, so a step's
kernels start early and wait on the device instead of paying each launch and ramp-up in turn.
A GEMV loads its first weight tile before the wait, overlapping the previous kernel's tail.

Invariants of a kernel launched with PDL:
- Before `pdl_wait` it reads only what no kernel writes while serving (weights, scales) and
  writes nothing.
- Every program calls `pdl_wait`, also one with nothing to do. A kernel whose programs all
  skipped the wait could finish before the kernel it follows. The kernel after it would then
  read too soon: its own wait only covers its immediate predecessor.

Kernels call `pdl_launch_dependents` first, so the next kernel is queued as soon as this one's
last program has started; its programs take free slots and wait there.
Off the GPU (Triton's interpreter), before sm90, and with FERRUM_DEBUG_NO_PDL=1 (an A/B switch)
kernels launch plainly and both calls compile to nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ferrum import envs
from ferrum.kernels import cuda_capability

# Programmatic dependent launch needs Hopper's griddepcontrol instructions.
MIN_PDL_CAPABILITY = (9, 0)


@functools.cache
def _device_takes_pdl(device_index: int | None) -> bool:
    return cuda_capability(device_index) >= MIN_PDL_CAPABILITY and not envs.debug_no_pdl()


def uses_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA GPU of sm90 or later, unless
    FERRUM_DEBUG_NO_PDL=1."""
    return device.type == "cuda" and _device_takes_pdl(device.index)


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
