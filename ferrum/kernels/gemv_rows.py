"""Triton few-row linear for fp16/bf16 weights: out = x @ W^T (+ bias) for 2..MAX_ROWS rows of x
(a speculative verify step's, a small decode batch's), W read once for all of them.

Tensor cores with the operands swapped (cuBLAS's "swap AB" for skinny products): a program
multiplies a [BLOCK_N, BLOCK_K] W tile by x's [BLOCK_K, ROWS] transpose, so the product's long
side is W's rows (Hopper's wgmma takes M >= 64) and x's rows, padded to ROWS = MAX_ROWS, are its
short side. Split-K: program (p, s) sums K steps s * steps_per_split onwards of output columns
[p * BLOCK_N, (p + 1) * BLOCK_N); with SPLIT_K > 1 the last of a tile's programs to arrive sums
the partials and stores the tile (`split_k_sum.py`, deterministic). Rows past M and columns
past N read row M - 1 / N - 1 again (never stored), so full tiles need no load masks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrum.kernels.arrival_counters import arrival_counters
from ferrum.kernels.gemv import check_linear_operands, load_along_k
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from ferrum.kernels.split_k_sum import arrive, sum_partials

# x's rows a launch takes, all in one program column (the short side of the product).
MAX_ROWS = 16


@dataclass(frozen=True, slots=True)
class GemvRowsTile:
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("BLOCK_N", "BLOCK_K", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if min(self.BLOCK_N, self.BLOCK_K) < 16:
            raise ValueError(
                f"BLOCK_N and BLOCK_K must be >= 16 (tensor cores), got {self.BLOCK_N}, "
                f"{self.BLOCK_K}"
            )


@triton.jit
def _gemv_rows_kernel(
    out_ptr,  # [M, N]
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N], read when HAS_BIAS
    partial_ptr,  # [num_tiles, SPLIT_K, BLOCK_N, ROWS] fp32, used when SPLIT_K > 1
    counter_ptr,  # [>= num_tiles] int32, zero between launches, used when SPLIT_K > 1
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
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    steps_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = split * steps_per_split * BLOCK_K
    k_end = tl.minimum(K, k_begin + steps_per_split * BLOCK_K)
    safe_n = tl.minimum(offs_n, N - 1)
    safe_rows = tl.minimum(rows, M - 1)
    w_ptrs = w_ptr + safe_n[:, None].to(tl.int64) * stride_wn + k_begin + offs_k[None, :]
    x_ptrs = x_ptr + safe_rows[:, None].to(tl.int64) * stride_xm + k_begin + offs_k[None, :]
    pdl_wait(USE_PDL)
    acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        w = load_along_k(w_ptrs, offs_k, K - k, EVEN_K)
        x = load_along_k(x_ptrs, offs_k, K - k, EVEN_K)
        acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SPLIT_K > 1:
        partials = partial_ptr + pid.to(tl.int64) * (SPLIT_K * BLOCK_N * ROWS)
        if not arrive(acc, partials, counter_ptr + pid, split, SPLIT_K):
            return
        acc = sum_partials(partials, counter_ptr + pid, SPLIT_K, BLOCK_N, ROWS)
    n_mask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + rows[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    mask = n_mask[:, None] & (rows < M)[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv_rows(
    x: torch.Tensor,  # [M, K], 1 <= M <= MAX_ROWS, stride(1) == 1, W's dtype
    weight: torch.Tensor,  # [N, K] fp16/bf16, stride(1) == 1
    tile: GemvRowsTile,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """[M, N] in x's dtype: x @ weight^T + bias, fp32 sums."""
    n, k = check_linear_operands(x, weight, bias)
    m = x.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1..{MAX_ROWS} rows, got {m}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    num_tiles = triton.cdiv(n, tile.BLOCK_N)
    if tile.SPLIT_K > 1:
        partials = torch.empty(
            num_tiles * tile.SPLIT_K * tile.BLOCK_N * MAX_ROWS,
            dtype=torch.float32,
            device=x.device,
        )
        counters = arrival_counters(x.device, num_tiles, "few-row GEMV")
    else:
        partials = counters = out
    _gemv_rows_kernel[(num_tiles, tile.SPLIT_K)](
        out,
        x,
        weight,
        weight if bias is None else bias,
        partials,
        counters,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % tile.BLOCK_K == 0,
        BLOCK_N=tile.BLOCK_N,
        BLOCK_K=tile.BLOCK_K,
        ROWS=MAX_ROWS,
        SPLIT_K=tile.SPLIT_K,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl_launch_args(x.device),
    )
    return out
