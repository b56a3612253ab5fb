"""Triton FP8 (e4m3fn) weight GEMV for decode-sized batches (the buckets give it one row):
out = x @ dequant(W)^T.

At one row a linear layer is a read of W: tensor-core tiles of 16+ rows and cuBLASLt's kernels
leave HBM idle there, so this kernel streams W [N, K] through CUDA cores instead. Program p
computes out[m, n0:n0 + BLOCK_N] for m = p % M (rows vary fastest, so the programs that read one
W tile run together and share it in L2), n0 = (p // M) * BLOCK_N, accumulating per lane in fp32
and summing once at the end.

The activations stay in their dtype (weight-only FP8, as the small-batch MoE GEMVs run): the
result is the fp32 product with the dequantized weights (`fp8_weight_only_matmul_ref`) up to the
order of the sums. It differs from the W8A8 GEMMs of larger batches by their activation rounding
(up to 2^-4 of each value), and is the closer of the two to the unquantized layer.

Block scales (w_scale [ceil(N / 128), K / 128]): BLOCK_N divides 128, so a program's rows share one
scale row, and BLOCK_K is a multiple of 128. Column k of the row enters the sum as
x[k] * w_scale[n0 // 128, k // 128]: the scales are applied to the activation, once per column
rather than once per weight. Per-channel scales (w_scale [N, 1]): out = sum(x * w) * w_scale[n].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.fp8_gemm import check_fp8_operands
from ferrum.kernels.fp8_gemm_config import check_gemv_tiles
from ferrum.kernels.fp8_quant import GROUP_SIZE
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _block_scaled_chunk(x, w_s, GROUP: tl.constexpr):
    """A [BLOCK_K] fp32 chunk of the row, each group of GROUP columns times its weight block's
    scale w_s [BLOCK_K // GROUP]."""
    NUM_GROUPS: tl.constexpr = x.shape[0] // GROUP
    xg = tl.reshape(x, (NUM_GROUPS, GROUP)) * w_s[:, None]
    return tl.reshape(xg, (x.shape[0],))


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
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # The first weight tile (and its scales) is read before the wait: weights are never written
    # while serving.
    w = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    if BLOCK_SCALES:
        NUM_GROUPS: tl.constexpr = BLOCK_K // GROUP
        num_k_groups = K // GROUP
        s_row = w_scale_ptr + ((pid_n * BLOCK_N) // GROUP) * num_k_groups
        offs_g = tl.arange(0, NUM_GROUPS)
        w_s = tl.load(s_row + offs_g, mask=offs_g < num_k_groups, other=0.0)
    pdl_wait(USE_PDL)
    x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
    if BLOCK_SCALES:
        x = _block_scaled_chunk(x, w_s, GROUP)
    acc = w.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_ptrs += BLOCK_K
        k_mask = offs_k < K - k0
        x = tl.load(x_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if BLOCK_SCALES:
            g_mask = offs_g < num_k_groups - k0 // GROUP
            w_s = tl.load(s_row + k0 // GROUP + offs_g, mask=g_mask, other=0.0)
            x = _block_scaled_chunk(x, w_s, GROUP)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, 1)
    if not BLOCK_SCALES:
        out *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
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
        GROUP=GROUP_SIZE,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch_args(x.device),
    )
    return out
