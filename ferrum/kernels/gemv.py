"""Triton GEMV for fp16/bf16 weights at one activation row: out = x @ W^T (+ bias), where cuBLAS
reads W below HBM speed at some decode shapes (`bench_gemv.py`). With ROWS rows a program, program
p computes rows [b * ROWS, (b + 1) * ROWS) of out[:, n0:n0 + BLOCK_N], b = p % cdiv(M, ROWS), n0 =
(p // cdiv(M, ROWS)) * BLOCK_N (programs sharing a W tile share it in L2). One row a program
(ROWS = 1, what the engine runs): fp32 per lane, summed once. Several (a verify step's or a small
batch's rows, `bench_gemv.py --rows`): each W tile is read once for all of them and reduced per
tile and row on CUDA cores. Only one-row batches take this GEMV in the engine: at 4-8 rows it is
1.2-3x slower than cuBLAS on the H200 (RESULTS, fifteenth session); few rows take gemv_rows.py
where a table lists them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.fp8_gemm_config import check_gemv_tiles
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

WEIGHT_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit
def load_along_k(ptrs, offs_k, k_left, EVEN_K: tl.constexpr):
    """A [BLOCK_K] chunk of a GEMV's row (or of its scales) or a [BLOCK_N, BLOCK_K] weight tile,
    zero past k_left columns (nothing masked with EVEN_K)."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_k < k_left, other=0.0)


@triton.jit
def rows_dot_x(w, w_ptrs, x_ptrs, offs_k, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """[BLOCK_N] fp32: a block of W's rows dotted with x along K, fp32 per lane, summed once;
    `w` is the first tile (at w_ptrs), loaded by the caller (before its PDL wait)."""
    x = load_along_k(x_ptrs, offs_k, K, EVEN_K)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x = load_along_k(x_ptrs, offs_k, K - k0, EVEN_K)
        w = load_along_k(w_ptrs, offs_k, K - k0, EVEN_K)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _gemv_kernel(
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
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(M, ROWS)
    offs_n = (pid // row_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Rows past N read row N - 1 again (stores are masked), so full tiles need no load mask.
    safe_n = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + safe_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # The first weight tile is read before the wait (weights are never written while serving).
    w = load_along_k(w_ptrs, offs_k, K, EVEN_K)
    pdl_wait(USE_PDL)
    if ROWS == 1:
        row = (pid % row_blocks).to(tl.int64)
        out = rows_dot_x(w, w_ptrs, row * stride_xm + x_ptr + offs_k, offs_k, K, BLOCK_K, EVEN_K)
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        out_ptrs = out_ptr + row * stride_om + offs_n
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        first_row = (pid % row_blocks) * ROWS
        rows = first_row + tl.arange(0, ROWS)
        row_mask = rows < M
        x_rows = x_ptr + first_row.to(tl.int64) * stride_xm
        outs = tile_rows_dot_xs(
            w, w_ptrs, x_rows, M - first_row, stride_xm, offs_k, K, ROWS, BLOCK_N, BLOCK_K, EVEN_K
        )  # fmt: skip
        if HAS_BIAS:
            outs += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        mask = row_mask[:, None] & n_mask[None, :]
        tl.store(out_ptrs, outs.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def add_rows_tile(acc, w, x_ptr, rows_left, stride_xm, offs_k, k_left, EVEN_K: tl.constexpr):
    """acc [ROWS, BLOCK_N] plus the W tile `w` dotted with each of x's rows at x_ptr (row r at
    x_ptr + r * stride_xm; rows from rows_left on read the last row again: their sums are never
    stored). W keeps the one-row GEMV's layout and each x row is one broadcast vector."""
    ROWS: tl.constexpr = acc.shape[0]
    row_ids = tl.arange(0, ROWS)
    wf = w.to(tl.float32)
    for r in tl.static_range(ROWS):
        x_row = x_ptr + tl.minimum(r, rows_left - 1).to(tl.int64) * stride_xm + offs_k
        x = load_along_k(x_row, offs_k, k_left, EVEN_K)
        part = tl.sum(wf * x.to(tl.float32)[None, :], 1)
        acc = tl.where(row_ids[:, None] == r, acc + part[None, :], acc)
    return acc


@triton.jit
def tile_rows_dot_xs(
    w,
    w_ptrs,
    x_ptr,
    rows_left,
    stride_xm,
    offs_k,
    K,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """[ROWS, BLOCK_N] fp32: a block of W's rows dotted with each of ROWS rows of x (from x_ptr,
    stride_xm apart; rows_left >= 1 of them real), each W tile read once for all of them; `w`
    is the first tile (at w_ptrs), loaded by the caller."""
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc = add_rows_tile(acc, w, x_ptr, rows_left, stride_xm, offs_k, K, EVEN_K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x_ptr += BLOCK_K
        w_ptrs += BLOCK_K
        w = load_along_k(w_ptrs, offs_k, K - k0, EVEN_K)
        acc = add_rows_tile(acc, w, x_ptr, rows_left, stride_xm, offs_k, K - k0, EVEN_K)
    return acc


def check_linear_operands(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[int, int]:
    """(N, K) of an [N, K] fp16/bf16 weight (stride(1) == 1) that x [M, K] (its dtype,
    stride(1) == 1) and bias [N] (its dtype, contiguous) fit; a ValueError naming the operand
    otherwise."""
    if weight.dim() != 2 or weight.dtype not in WEIGHT_DTYPES or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be [N, K] fp16/bf16 with stride(1) == 1, got "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != weight.dtype or x.stride(1) != 1:
        raise ValueError(
            f"x must be [M, {k}] {weight.dtype} with stride(1) == 1, got {tuple(x.shape)} {x.dtype}"
        )
    if bias is not None and (
        bias.shape != (n,) or bias.dtype != weight.dtype or bias.stride(0) != 1
    ):
        raise ValueError(
            f"bias must be contiguous [{n}] {weight.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )
    return n, k


def gemv(
    x: torch.Tensor,  # [M, K], stride(1) == 1, W's dtype
    weight: torch.Tensor,  # [N, K] fp16/bf16, stride(1) == 1
    block_n: int,
    block_k: int,
    num_warps: int = 4,
    num_stages: int = 2,
    bias: torch.Tensor | None = None,  # [N]
    rows_per_program: int = 1,
) -> torch.Tensor:
    """[M, N] in x's dtype: x @ weight^T + bias, fp32 sums; `rows_per_program` (a power of two
    <= 16) rows of x share each program's reads of W."""
    n, k = check_linear_operands(x, weight, bias)
    check_gemv_tiles(False, block_n, block_k)
    if not 1 <= rows_per_program <= 16 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program: a power of two <= 16, got {rows_per_program}")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    row_blocks = triton.cdiv(m, rows_per_program)
    _gemv_kernel[(row_blocks * triton.cdiv(n, block_n),)](
        out,
        x,
        weight,
        weight if bias is None else bias,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % block_k == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        ROWS=rows_per_program,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch_args(x.device),
    )
    return out
