"""Inputs for the FP8 kernel tests.

The Triton 3.6 CPU interpreter rounds fp32 -> fp8 without carrying into the exponent (126.7
becomes 64, not 128) and mishandles fp8 subnormals, so kernels that quantize are checked on the
CPU with `representable` inputs: each group is fp8 normal codes (or 0) times a power of two, with
one +-448 per group, so that the scale is that power of two and quantizing is exact. Random inputs
run on CUDA, where the hardware conversion rounds to nearest even.
"""

from __future__ import annotations

import pytest
import torch

FP8 = torch.float8_e4m3fn
FP8_MIN_NORMAL = 2.0**-6

cuda_only = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="the Triton CPU interpreter's fp32->fp8 cast does not round to nearest",
)


def representable(
    rows: int, cols: int, group: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> torch.Tensor:
    """[rows, cols] of dtype, each run of `group` columns exactly code * 2^e (e in [-8, 0])."""
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randn(rows, cols, generator=gen) * 100).to(FP8).float()
    codes[codes.abs() < FP8_MIN_NORMAL] = 0.0
    num_groups = -(-cols // group)
    peak = torch.randint(0, group, (rows, num_groups), generator=gen)
    peak_cols = (torch.arange(num_groups) * group + peak).clamp(max=cols - 1)
    signs = torch.where(torch.rand(rows, num_groups, generator=gen) < 0.5, -448.0, 448.0)
    codes.scatter_(1, peak_cols, signs)
    exps = torch.randint(-8, 1, (rows, num_groups), generator=gen).float()
    scale = torch.exp2(exps).repeat_interleave(group, dim=1)[:, :cols]
    return (codes * scale).to(device, dtype)


def random_input(
    rows: int, cols: int, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> torch.Tensor:
    """Rows of mixed magnitudes (per-row scales from 1e-3 to 10), one outlier column."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 1, rows)[:, None]
    if cols > 3:
        x[:, 3] *= 20
    return x.to(device, dtype)
