"""W8A8 grouped fused MoE: FP8 experts (128x128 block scales) times FP8 activations quantized per
token-group of 128 (`Fp8GroupRows`), e4m3 x e4m3 `tl.dot` with fp32 accumulate, each K step's
partial scaled by a_scale[row, k // 128] * w_scale[e, n // 128, k // 128]. After the align
(`moe_align`), two launches: the gate/up GEMM whose epilogue is SiLU-and-mul then the act rows
quantized per group (its column tile covers whole groups), and the down GEMM times the routing
weight into fp32 pair rows, which fused_moe's combine sums over k. Roundings as
`fused_moe_w8a8_ref`: each matmul, the silu and the product in the model dtype. CUDA-graph safe
(sizes from (T, k, E, H, I) only); FP8 dots need sm89+ (fused_moe_rule.uses_fp8_activations)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.fp8_quant import (
    AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    Fp8GroupRows,
    empty_group_rows,
    fp8_scale_of,
    quantize_fp8_tile,
)
from ferrum.kernels.fused_moe_config import W8A8_BLOCK

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _w_scales(w_s_ptrs, w_s_tile, k_block, n_mask, BLOCK_N: tl.constexpr):
    """One K block's weight scales of the tile's columns, [1, BLOCK_N]; a tile that is one
    128-row block (BLOCK_N == 128) loads its one scale (a scalar, broadcast)."""
    if BLOCK_N == 128:
        scales = tl.load(w_s_tile + k_block)
    else:
        scales = tl.load(w_s_ptrs + k_block, mask=n_mask, other=0.0)[None, :]
    return scales


@triton.jit
def _store_act_groups(
    q_ptr,  # [num_pairs, N] fp8
    scale_ptr,  # [num_pairs, N / 128] fp32
    y,  # [BLOCK_M, BLOCK_N] fp32, the act tile (columns past N are zero)
    pairs,  # [BLOCK_M] the tile's rows
    row_mask,
    col0,  # the tile's first column, a multiple of BLOCK_N
    N,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
):
    """Quantizes the tile per 128-column group (fp8_quant's math) and stores codes and scales."""
    groups = tl.reshape(y, (BLOCK_M, BLOCK_N // 128, 128))
    amax = tl.max(tl.abs(groups), 2)
    q, _ = quantize_fp8_tile(groups, amax[:, :, None], FP8_MAX, AMAX_FLOOR)
    rows = pairs.to(tl.int64)[:, None]
    offs_n = col0 + tl.arange(0, BLOCK_N)
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    tl.store(q_ptr + rows * N + offs_n[None, :], tl.reshape(q, (BLOCK_M, BLOCK_N)), mask=mask)
    group_ids = col0 // 128 + tl.arange(0, BLOCK_N // 128)
    s_mask = row_mask[:, None] & (group_ids < N // 128)[None, :]
    tl.store(scale_ptr + rows * (N // 128) + group_ids[None, :], fp8_scale_of(amax, FP8_MAX,
             AMAX_FLOOR), mask=s_mask)  # fmt: skip


@triton.jit(do_not_specialize=("num_pairs",))
def _moe_w8a8_gemm_kernel(
    out_ptr,  # [num_pairs, N]: fp8 act codes (GATED), else fp32 weighted rows
    out_scale_ptr,  # [num_pairs, N / 128] fp32, written when GATED
    a_ptr,  # [num_pairs // A_ROW_DIV, K] fp8, contiguous
    a_scale_ptr,  # [num_pairs // A_ROW_DIV, K / 128] fp32, contiguous
    w_ptr,  # [E, N or 2N (GATED), K] fp8, contiguous
    w_scale_ptr,  # [E, (N or 2N) / 128, K / 128] fp32, contiguous
    topk_weights_ptr,  # [num_pairs] fp32, read unless GATED
    sorted_pair_ids_ptr,  # [max_blocks * BLOCK_M] int32
    expert_ids_ptr,  # [max_blocks] int32
    num_post_padded_ptr,  # [1] int32
    N,
    K,
    num_pairs,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    DTYPE: tl.constexpr,  # the model's activation dtype: each matmul rounds to it
    FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # a multiple of 128
    BLOCK_K: tl.constexpr,  # divides 128
):
    """Program (n, m): the pairs of M-block m (all of expert e) against columns n*BLOCK_N.. of
    w[e]. GATED: y = silu(round(a @ w[e, :N]^T)) * round(a @ w[e, N:]^T), stored as FP8 codes and
    one scale per 128 columns; else out = round(a @ w[e]^T) * topk_weight[pair]. K % 128 == 0."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    num_kb = K // 128
    a_ptrs = a_ptr + a_rows[:, None] * K + offs_k[None, :]
    a_s_ptrs = a_scale_ptr + a_rows * num_kb
    # W^T tiles [BLOCK_K, BLOCK_N] of w [N, K]: K contiguous, as FP8 tensor cores read them.
    w_ptrs = w_ptr + expert * (2 if GATED else 1) * N * K + offs_n[None, :].to(tl.int64) * K
    w_ptrs += offs_k[:, None]
    w_s_tile = (
        w_scale_ptr + (expert * (2 if GATED else 1) * (N // 128) + pid_n * BLOCK_N // 128) * num_kb
    )
    w_s_ptrs = w_s_tile + (tl.arange(0, BLOCK_N) // 128) * num_kb
    up_s = (N // 128) * num_kb  # the up rows' scales after the gate rows'
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
        a_s = tl.load(a_s_ptrs + k0 // 128, mask=row_mask, other=0.0)[:, None]
        w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
        w_s = _w_scales(w_s_ptrs, w_s_tile, k0 // 128, n_mask, BLOCK_N)
        acc += tl.dot(a, w) * (a_s * w_s)
        if GATED:
            w_up = tl.load(w_ptrs + N * K, mask=n_mask[None, :], other=0.0)
            w_up_s = _w_scales(w_s_ptrs + up_s, w_s_tile + up_s, k0 // 128, n_mask, BLOCK_N)
            acc_up += tl.dot(a, w_up) * (a_s * w_up_s)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    result = acc.to(DTYPE).to(tl.float32)
    if GATED:
        act = (result / (1.0 + tl.exp(-result))).to(DTYPE).to(tl.float32)
        y = (act * acc_up.to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        _store_act_groups(out_ptr, out_scale_ptr, y, pairs, row_mask, pid_n * BLOCK_N, N, BLOCK_M,
                          BLOCK_N, FP8_MAX, AMAX_FLOOR)  # fmt: skip
    else:
        weight = tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)
        out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(out_ptrs, result * weight[:, None], mask=row_mask[:, None] & n_mask[None, :])


def check_rows(rows: Fp8GroupRows, hidden: torch.Tensor) -> None:
    """`rows` must be hidden's rows quantized per group: [T, H] codes, [T, H / 128] scales."""
    num_tokens, hidden_size = hidden.shape
    scale_shape = (num_tokens, hidden_size // W8A8_BLOCK)
    if (
        tuple(rows.q.shape) != (num_tokens, hidden_size)
        or rows.q.dtype != FP8_DTYPE
        or not rows.q.is_contiguous()
        or tuple(rows.scales.shape) != scale_shape
        or rows.scales.dtype != torch.float32
        or not rows.scales.is_contiguous()
        or rows.q.device != hidden.device
        or rows.scales.device != hidden.device
    ):
        raise ValueError(
            f"x_fp8 must be contiguous [{num_tokens}, {hidden_size}] fp8 codes and "
            f"{list(scale_shape)} fp32 scales on {hidden.device}, got {tuple(rows.q.shape)} "
            f"{rows.q.dtype} and {tuple(rows.scales.shape)} {rows.scales.dtype}"
        )


def _launch(
    out: torch.Tensor,
    out_scales: torch.Tensor,
    a: Fp8GroupRows,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    n: int,
    a_row_div: int,
    dtype: torch.dtype,
    config: dict[str, int],
) -> None:
    """One grouped GEMM: gate/up (GATED) when out holds FP8 codes, else down."""
    if not w_scale.is_contiguous():
        raise ValueError(f"W8A8 experts' block scales must be contiguous, got {w_scale.stride()}")
    sorted_pair_ids, expert_ids, num_post_padded = align
    grid = (triton.cdiv(n, config["BLOCK_N"]), expert_ids.numel())
    _moe_w8a8_gemm_kernel[grid](
        out, out_scales, a.q, a.scales, w, w_scale, topk_weights, sorted_pair_ids, expert_ids,
        num_post_padded, n, a.q.shape[1], out.shape[0], A_ROW_DIV=a_row_div,
        GATED=out.dtype == FP8_DTYPE,
        DTYPE=_TL_DTYPES[dtype], FP8_MAX=FP8_MAX, AMAX_FLOOR=AMAX_FLOOR,
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )  # fmt: skip


def w8a8_pair_rows(
    x: Fp8GroupRows,  # hidden's rows quantized per token-group: [T, H]
    w13: torch.Tensor,  # [E, 2I, H] fp8
    w2: torch.Tensor,  # [E, H, I] fp8
    w13_scale: torch.Tensor,  # [E, 2I / 128, H / 128] fp32
    w2_scale: torch.Tensor,  # [E, H / 128, I / 128] fp32
    flat_weights: torch.Tensor,  # [T * k] fp32
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # moe_align at config's BLOCK_M
    top_k: int,
    dtype: torch.dtype,
    config: dict[str, int],
) -> torch.Tensor:
    """The two W8A8 grouped GEMMs: [T * k, H] fp32 rows, pair p's expert output times its
    routing weight (rows of pairs routed to no local expert are left unwritten). `config` is
    checked already (`check_w8a8_config`: tuned tables as they load, a caller's at fused_moe's
    entry; the rule's by construction)."""
    num_pairs = flat_weights.numel()
    hidden_size, inter = w2.shape[1], w2.shape[2]
    act = empty_group_rows(num_pairs, inter, x.q.device)
    _launch(act.q, act.scales, x, w13, w13_scale, flat_weights, align, inter, top_k, dtype, config)
    pair_out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=x.q.device)
    _launch(pair_out, pair_out, act, w2, w2_scale, flat_weights, align, hidden_size, 1, dtype,
            config)  # fmt: skip
    return pair_out
