"""Triton W4A16 GEMM: out = x @ W^T (+ bias) with W in int4_ref's layout (int32 words of 8 codes
along K, per-group scales and zero points, optional g_idx), dequantized in registers tile by tile
and multiplied on the tensor cores in x's dtype. The tile depends on W's shape alone, so each
output row is the same whatever the batch (as batch_invariant_matmul)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.batch_invariant_matmul import gemm_rows, store_tile, tile_rows_cols
from ferrum.kernels.int4_ref import NIBBLES
from ferrum.kernels.paged_attention_common import _dot_precision

ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=("M",))
def _w4a16_kernel(
    out_ptr,  # [M, N]
    x_ptr,  # [M, K]
    packed_ptr,  # [N, K / 8] int32
    scale_ptr,  # [N, G]
    zero_ptr,  # [N, G] uint8, read when HAS_ZERO
    g_idx_ptr,  # [K] int32, read when HAS_G_IDX
    bias_ptr,  # [N], read when HAS_BIAS
    M,
    N,
    K,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_zn,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (n_tile, m_tile) (`tile_rows_cols`). K is a multiple of 8 (whole words)."""
    offs_m, offs_n, rows, cols = tile_rows_cols(M, N, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + rows[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=k_in[None, :], other=0.0)
        words = tl.load(
            packed_ptr + cols[None, :] * stride_pn + (offs_k // 8)[:, None],
            mask=k_in[:, None],
            other=0,
        )  # [BLOCK_K, BLOCK_N], each word read for its 8 codes
        codes = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        if HAS_G_IDX:
            groups = tl.load(g_idx_ptr + offs_k, mask=k_in, other=0)
        else:
            groups = offs_k // GROUP_SIZE
        group_col = groups[:, None].to(tl.int64)
        # Past K: scale 0 and zero 0, so the tail's weights are 0 (never undefined lanes).
        scales = tl.load(
            scale_ptr + cols[None, :] * stride_sn + group_col, mask=k_in[:, None], other=0.0
        )
        if HAS_ZERO:
            zeros = tl.load(
                zero_ptr + cols[None, :] * stride_zn + group_col, mask=k_in[:, None], other=0
            )
            codes = codes - zeros.to(tl.int32)
        else:
            codes = codes - 8  # int4_ref.SYMMETRIC_ZERO
        w = (codes.to(tl.float32) * scales.to(tl.float32)).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, cols, M, N, stride_om, HAS_BIAS)


def _tile(n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the weight's shape alone."""
    return 16 if n < 4096 else 32, 64, 64, 4, 3


def int4_linear(
    x: torch.Tensor,  # [..., K]
    packed: torch.Tensor,  # [N, K / 8] int32
    scale: torch.Tensor,  # [N, G]
    zero: torch.Tensor | None,  # [N, G] uint8
    g_idx: torch.Tensor | None,  # [K] int32
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., N] in x's dtype; the same product as `int4_linear_ref`."""
    n, words = packed.shape
    k = words * NIBBLES
    if x.shape[-1] != k or x.dtype not in ACT_DTYPES:
        raise ValueError(f"x must be [..., {k}] fp16/bf16/fp32, got {list(x.shape)} {x.dtype}")
    x2, out = gemm_rows(x, n)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    block_m, block_n, block_k, warps, stages = _tile(n)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _w4a16_kernel[grid](
        out, x2, packed, scale, scale if zero is None else zero,
        packed if g_idx is None else g_idx, out if bias is None else bias,
        m, n, k, x2.stride(0), packed.stride(0), scale.stride(0),
        scale.stride(0) if zero is None else zero.stride(0), out.stride(0),
        GROUP_SIZE=group_size, HAS_ZERO=zero is not None, HAS_G_IDX=g_idx is not None,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(x.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n)
