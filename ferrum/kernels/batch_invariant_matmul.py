"""Batch-invariant dense GEMM: out = x @ W^T (+ bias), each output row computed the same way
whatever the number of rows, their order and their neighbours. The tile depends on W's shape
alone (`invariant_tile`), never on M; every output element sums K in BLOCK_K steps from k = 0, one
tl.dot at a time into an fp32 accumulator (no split-K), so a row gives the same bits alone, in a
batch of 512, or in a prompt chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrum.kernels.paged_attention_common import _dot_precision

# Weight dtypes the kernel reads (the model dtype; FP8 weights have their own GEMM).
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, slots=True)
class InvariantTile:
    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int
    num_stages: int


def invariant_tile(n: int, k: int, dtype: torch.dtype) -> InvariantTile:
    """The one tile of an [N, K] weight: 64 rows (decode batches fill a tile; prompt chunks take
    several), 128 columns on wide weights and 64 elsewhere (more programs for one row), 64 K steps.
    Shared memory stays under 100 KB (L40S-class GPUs): 4 stages of 2-byte tiles, 2 of fp32."""
    block_n = 128 if n >= 16384 else 64
    stages = 2 if dtype == torch.float32 else 4
    return InvariantTile(64, block_n, 64, 4, stages)


# One compiled kernel for every row count (Triton would specialise M == 1 and M % 16 == 0).
@triton.jit
def tile_rows_cols(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (n_tile, m_tile)'s output offsets and the rows / columns it reads: past M it
    reads row M - 1 and past N column N - 1 (int64), so no row's loads depend on its tile."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    cols = tl.minimum(offs_n, N - 1).to(tl.int64)
    return offs_m, offs_n, rows, cols


@triton.jit
def store_tile(
    acc, out_ptr, bias_ptr, offs_m, offs_n, cols, M, N, stride_om, HAS_BIAS: tl.constexpr
):
    """acc (+ bias) into out's rows offs_m and columns offs_n inside [M, N], in out's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm_rows(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x as [M, K] rows (contiguous along K) and an empty [M, N] output in x's dtype."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > 0 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)


@triton.jit(do_not_specialize=("M",))
def _invariant_matmul_kernel(
    out_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N], read when HAS_BIAS
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (n_tile, m_tile): out[m_tile rows, n_tile columns] (`tile_rows_cols`)."""
    offs_m, offs_n, rows, cols = tile_rows_cols(M, N, BLOCK_M, BLOCK_N)
    x_rows = x_ptr + rows[:, None] * stride_xm
    w_cols = w_ptr + cols[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_in = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=k_in[None, :], other=0.0)
        b = tl.load(w_cols + offs_k[:, None], mask=k_in[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, cols, M, N, stride_om, HAS_BIAS)


def invariant_linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """[..., N] in x's dtype; each row's bits independent of the others (module docstring)."""
    n, k = weight.shape
    if x.shape[-1] != k or x.dtype != weight.dtype or weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(
            f"x must be [..., {k}] in the weight's dtype {weight.dtype} (fp16/bf16/fp32), got "
            f"{list(x.shape)} {x.dtype}"
        )
    if weight.stride(1) != 1:
        raise ValueError("weight must be contiguous along K")
    x2, out = gemm_rows(x, n)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    tile = invariant_tile(n, k, weight.dtype)
    grid = (triton.cdiv(n, tile.BLOCK_N), triton.cdiv(m, tile.BLOCK_M))
    _invariant_matmul_kernel[grid](
        out,
        x2,
        weight,
        out if bias is None else bias,
        m,
        n,
        k,
        x2.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=tile.BLOCK_M,
        BLOCK_N=tile.BLOCK_N,
        BLOCK_K=tile.BLOCK_K,
        DOT_PRECISION=_dot_precision(weight.dtype),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out.view(*x.shape[:-1], n)
