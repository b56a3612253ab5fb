"""Triton FP8 (e4m3fn) weight GEMV for decode-sized batches: out = x @ dequant(W)^T. At one row a
linear layer is a read of W that tensor-core tiles and cuBLASLt leave below HBM speed, so W streams
through CUDA cores: program p computes out[p % M, n0:n0 + BLOCK_N], n0 = (p // M) * BLOCK_N (rows
vary fastest, sharing W tiles in L2), fp32 per lane. Weight-only: x stays in its dtype (closer to
the unquantized layer than W8A8, which rounds x to 2^-4). Block scales (BLOCK_N divides 128, BLOCK_K
a multiple of 128): x[k] * w_scale[n0 // 128, k // 128]; per-channel: sum(x * w) * w_scale[n]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.fp8_gemm import check_fp8_operands
from ferrum.kernels.fp8_gemm_config import check_gemv_tiles
from ferrum.kernels.fp8_quant import GROUP_SIZE
from ferrum.kernels.gemv import load_along_k
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _fp8_gemv_kernel(
    out_ptr,  # [M, N]
    x_ptr,  # [M, K] fp16/bf16/fp32
    w_ptr,  # [N, K] fp8
    w_scale_ptr,  # [ceil(N / GROUP), K // GROUP] (BLOCK_SCALES) or [N, 1] fp32
    bias_ptr,  # [N], read when HAS_BIAS
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    row = (pid % M).to(tl.int64)
    pid_n = pid // M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Rows past N read row N - 1 again (stores are masked), so weight loads need no row mask.
    safe_n = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + row * stride_xm + offs_k
    # Weight columns are read 8 to a thread, as the 16-bit row is: the row chunk then lies in the
    # tile's own column layout, and no step moves it between threads.
    w_cols = tl.max_contiguous(offs_k, 8)
    w_ptrs = w_ptr + safe_n[:, None].to(tl.int64) * stride_wn + w_cols[None, :]
    # Each column's block scale, gathered in the row chunk's own layout (groups of GROUP columns
    # repeat one address): the scales multiply the chunk without moving it between threads.
    w_scale_ptrs = w_scale_ptr + ((pid_n * BLOCK_N) // GROUP) * (K // GROUP) + offs_k // GROUP
    # The first weight tile (and its scales) is read before the wait: weights are never written
    # while serving.
    w = load_along_k(w_ptrs, offs_k[None, :], K, EVEN_K)
    if BLOCK_SCALES:
        w_s = load_along_k(w_scale_ptrs, offs_k, K, EVEN_K)
    pdl_wait(USE_PDL)
    x = load_along_k(x_ptrs, offs_k, K, EVEN_K).to(tl.float32)
    if BLOCK_SCALES:
        x *= w_s
    acc = w.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x = load_along_k(x_ptrs, offs_k, K - k0, EVEN_K).to(tl.float32)
        w = load_along_k(w_ptrs, offs_k[None, :], K - k0, EVEN_K)
        if BLOCK_SCALES:
            w_scale_ptrs += BLOCK_K // GROUP
            x *= load_along_k(w_scale_ptrs, offs_k, K - k0, EVEN_K)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, 1)
    if not BLOCK_SCALES:
        out *= tl.load(w_scale_ptr + safe_n)
    if HAS_BIAS:
        out += tl.load(bias_ptr + safe_n).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def fp8_gemv(
    x: torch.Tensor,  # [M, K] fp16/bf16/fp32, stride(1) == 1
    weight: torch.Tensor,  # [N, K] fp8, stride(1) == 1
    weight_scale: torch.Tensor,  # [ceil(N / 128), K / 128] (block_scales) or [N, 1] fp32
    out_dtype: torch.dtype,
    block_scales: bool,
    block_n: int,
    block_k: int,
    num_warps: int = 4,
    num_stages: int = 2,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """[M, N] out_dtype: x times the dequantized W^T (fp32 sums), plus bias."""
    if x.dim() != 2 or x.dtype not in _IN_DTYPES or x.stride(1) != 1:
        raise ValueError(
            f"x must be [M, K] fp16/bf16/fp32 with stride(1) == 1, got {tuple(x.shape)} {x.dtype}"
        )
    m, n, k = check_fp8_operands(x, weight, weight_scale, block_scales, bias, out_dtype)
    check_gemv_tiles(block_scales, block_n, block_k)
    out = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    _fp8_gemv_kernel[(m * triton.cdiv(n, block_n),)](
        out,
        x,
        weight,
        weight_scale,
        weight_scale if bias is None else bias,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_SCALES=block_scales,
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        GROUP=GROUP_SIZE,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch_args(x.device),
    )
    return out
