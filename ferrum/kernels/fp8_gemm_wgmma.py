"""Hopper W8A8 FP8 GEMM with block scales in Gluon: out = A @ W^T, bf16/fp16, scales as fp8_gemm's.
Why Gluon: a K step's product must be complete before its scales apply, and Triton's pipeliner
waits for each wgmma right after issuing it, idling the tensor cores; here each step's wgmma runs
asynchronously while the previous one is scaled (`num_outstanding=1`), TMA loads NUM_STAGES ahead.
Needs Triton 3.5+'s Gluon (else `wgmma_gemm_takes` is False). Invariants: BLOCK_K == 128 and
K % 128 == 0, BLOCK_N divides 128 (one scale of each a step); TMA zero-fills loads past M and N and
clips stores."""

from __future__ import annotations

import torch

from ferrum.kernels import cuda_capability
from ferrum.kernels.fp8_gemm import check_fp8_operands
from ferrum.kernels.fp8_gemm_config import SCALE_BLOCK, check_wgmma_tile

try:  # Gluon's Hopper API, as the kernel uses it (Triton 3.5 on)
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401

    TRITON_HAS_GLUON_HOPPER = True
except ImportError:  # an older Triton: wgmma buckets run their tile on the Triton GEMM
    TRITON_HAS_GLUON_HOPPER = False

if TRITON_HAS_GLUON_HOPPER:  # any error in the kernel module itself is raised, not hidden
    from ferrum.kernels.fp8_gemm_wgmma_kernel import OUT_DTYPES, launch
else:
    OUT_DTYPES = ()


def wgmma_gemm_takes(device: torch.device, out_dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether this kernel serves x [M, K] @ W[N, K]^T into out_dtype on this device: Hopper
    (wgmma is sm90 only) with a Triton that has Gluon, whole scale groups along K, 16-byte output
    rows for TMA."""
    return (
        TRITON_HAS_GLUON_HOPPER
        and device.type == "cuda"
        and out_dtype in OUT_DTYPES
        and k % SCALE_BLOCK == 0
        and n % 8 == 0
        and cuda_capability(device.index) == (9, 0)
    )


def w8a8_block_fp8_matmul_wgmma(
    a: torch.Tensor,  # [M, K] fp8, contiguous
    a_scale: torch.Tensor,  # [M, K / 128] fp32, contiguous
    weight: torch.Tensor,  # [N, K] fp8, contiguous
    w_scale: torch.Tensor,  # [ceil(N / 128), K / 128] fp32, contiguous
    out_dtype: torch.dtype,
    block_m: int = 64,
    block_n: int = 128,
    num_warps: int = 4,
    num_stages: int = 4,
    unroll: int = 2,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """[M, N] out_dtype; callers check `wgmma_gemm_takes` first."""
    m, n, k = check_fp8_operands(a, weight, w_scale, True, bias, out_dtype, a_scale)
    check_wgmma_tile(block_m, block_n, num_warps, num_stages, unroll)
    if not wgmma_gemm_takes(a.device, out_dtype, n, k):
        raise ValueError(
            "the wgmma GEMM needs a Hopper GPU, a Triton with Gluon, a bf16/fp16 output, "
            f"K % 128 == 0 and N % 8 == 0, got {a.device} {out_dtype} N={n} K={k}"
        )
    for name, t in (("a", a), ("weight", weight)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError(f"{name} must be contiguous and 16-byte aligned (TMA)")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    launch(out, a, a_scale, weight, w_scale, bias, block_m, block_n, num_warps, num_stages, unroll)
    return out
