"""Triton fused mixture-of-experts over stacked expert weights:
    out[t] = sum_j w[t, j] * w2[e] @ (silu(g) * u),  e = topk_ids[t, j],  (g, u) = w13[e] @ x[t]
with `fused_moe_ref`'s roundings (each matmul, the silu and the product in the input dtype; the sum
over j in fp32, j = 0..k-1). Up to SMALL_BATCH_MAX_TOKENS: two GEMVs (`fused_moe_small_batch`);
else pairs grouped by expert, padded to BLOCK_M (`moe_align`), a grouped GEMM for w13 (SiLU-and-mul)
and for w2 (times the routing weight), and a combine of each token's k rows. CUDA-graph safe (sizes
from (T, k, E, H, I) only). FP8 experts (128x128 block scales), weight-only: activations stay in
their dtype, each K step's fp32 partial scaled by its block's scale (`fused_moe_fp8_ref`); W8A8
(`fused_moe_w8a8`, from fused_moe_rule.W8A8_MIN_TOKENS on sm89+): FP8 activations and FP8 dots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.device_properties import DeviceProperties, device_properties
from ferrum.kernels.fp8_quant import Fp8GroupRows, per_token_group_quant_fp8
from ferrum.kernels.fused_moe_checks import FP8_BLOCK, check_moe_inputs
from ferrum.kernels.fused_moe_config import DEFAULT_GROUPED, check_w8a8_config, pick
from ferrum.kernels.fused_moe_rule import moe_configs, uses_fp8_activations, w8a8_configs
from ferrum.kernels.fused_moe_small_batch import SMALL_BATCH_MAX_TOKENS, small_batch_moe
from ferrum.kernels.fused_moe_w8a8 import check_rows, w8a8_pair_rows
from ferrum.kernels.moe_align import moe_align_block_size

_COMBINE_BLOCK = 1024


@triton.jit
def _moe_gemm_kernel(
    out_ptr,  # [num_pairs, N]
    a_ptr,  # [num_pairs // A_ROW_DIV, K]
    w_ptr,  # [E, N or 2N (GATED), K]
    w_scale_ptr,  # [E, (N or 2N) / 128, K / 128] float32, read when W_FP8
    topk_weights_ptr,  # [num_pairs] float32, read when MUL_WEIGHT
    sorted_pair_ids_ptr,  # [max_blocks * BLOCK_M] int32
    expert_ids_ptr,  # [max_blocks] int32
    num_post_padded_ptr,  # [1] int32
    N,
    K,
    num_pairs,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    stride_se,
    stride_sn,
    A_ROW_DIV: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    W_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (n, m): rows = pairs of M-block m (all of one expert e), columns n*BLOCK_N.. of
    out[pair] = a[pair // A_ROW_DIV] @ w[e]^T. GATED: out = silu(a @ w[e, :N]^T) * (a @ w[e, N:]^T).
    MUL_WEIGHT: out = round(a @ w[e]^T) * topk_weight[pair] in fp32. Padding rows are not stored.
    W_FP8: BLOCK_K divides 128, so each K step reads one scale column of the 128x128 blocks."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + offs_m)
    row_mask = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_ptrs = w_scale_ptr + expert * stride_se + (offs_n // 128) * stride_sn
    dtype = a_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        if W_FP8:
            scale = tl.load(s_ptrs + k0 // 128, mask=n_mask, other=0.0)
            acc += tl.dot(a, w.to(dtype), input_precision=DOT_PRECISION) * scale[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=w_mask, other=0.0)
            if W_FP8:
                scale = tl.load(s_ptrs + (N // 128) * stride_sn + k0 // 128, mask=n_mask, other=0.0)
                acc_up += tl.dot(a, w_up.to(dtype), input_precision=DOT_PRECISION) * scale[None, :]
            else:
                acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    result = acc.to(dtype).to(tl.float32)
    if GATED:
        up = acc_up.to(dtype).to(tl.float32)
        act = (result / (1.0 + tl.exp(-result))).to(dtype).to(tl.float32)
        result = act * up
    if MUL_WEIGHT:
        result = result * tl.load(topk_weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(
        out_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :]
    )


@triton.jit
def _moe_combine_kernel(
    out_ptr,  # [num_tokens, H]
    pair_out_ptr,  # [num_tokens * top_k, H] float32
    topk_ids_ptr,  # [num_tokens * top_k] int32/int64
    hidden_size,
    top_k,
    num_experts,
    stride_om,
    stride_pm,
    BLOCK: tl.constexpr,
):
    """Program (t, c): out[t, c*BLOCK..] = sum over j = 0..k-1 in order, in fp32, of
    pair_out[t * top_k + j], rounded to out's dtype; pairs whose expert id lies outside
    [0, num_experts) (no GEMM wrote their row) count as zero."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden_size
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, top_k):
        pair = token * top_k + j
        expert = tl.load(topk_ids_ptr + pair)
        routed = (expert >= 0) & (expert < num_experts)
        total += tl.load(pair_out_ptr + pair * stride_pm + offs, mask=mask & routed, other=0.0)
    tl.store(out_ptr + token * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def get_config(num_tokens: int) -> dict[str, int]:
    """The grouped path's default tile config (no tuned file) for a batch of num_tokens."""
    return pick(DEFAULT_GROUPED, num_tokens)


def _tile(block: int, dim: int) -> int:
    """The block shrunk to the dimension (tl.dot needs >= 16)."""
    return max(16, min(block, triton.next_power_of_2(dim)))


def _launch_gemm(
    out: torch.Tensor,
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    topk_weights: torch.Tensor,
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    n: int,
    a_row_div: int,
    gated: bool,
    config: dict[str, int],
) -> None:
    sorted_pair_ids, expert_ids, num_post_padded = align
    k = a.shape[1]
    block_n, block_k = _tile(config["BLOCK_N"], n), _tile(config["BLOCK_K"], k)
    if w_scale is not None:
        block_k = min(block_k, FP8_BLOCK)
    scales = w if w_scale is None else w_scale
    grid = (triton.cdiv(n, block_n), expert_ids.numel())
    _moe_gemm_kernel[grid](
        out,
        a,
        w,
        scales,
        topk_weights,
        sorted_pair_ids,
        expert_ids,
        num_post_padded,
        n,
        k,
        out.shape[0],
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        scales.stride(0),
        scales.stride(1),
        A_ROW_DIV=a_row_div,
        GATED=gated,
        MUL_WEIGHT=not gated,
        W_FP8=w_scale is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config["BLOCK_M"],
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )


def _grouped_moe(
    out: torch.Tensor,
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    flat_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict[str, int],
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> None:
    """Align, two grouped GEMMs ([T*k, H] fp32 weighted rows), then the combine over k."""
    num_tokens, hidden_size = hidden.shape
    num_experts, _, inter = w2.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    align = moe_align_block_size(topk_ids, num_experts, config["BLOCK_M"])
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _launch_gemm(act, hidden, w13, w13_scale, flat_weights, align, inter, top_k, True, config)
    pair_out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    _launch_gemm(pair_out, act, w2, w2_scale, flat_weights, align, hidden_size, 1, False, config)
    _combine(out, pair_out, topk_ids, num_experts)


def _combine(
    out: torch.Tensor, pair_out: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
) -> None:
    """out[t] = the sum over j of pair_out[t * k + j] (zero where the expert is not local)."""
    num_tokens, hidden_size = out.shape
    top_k = topk_ids.shape[1]
    block = min(_COMBINE_BLOCK, triton.next_power_of_2(hidden_size))
    _moe_combine_kernel[(num_tokens, triton.cdiv(hidden_size, block))](
        out,
        pair_out,
        topk_ids.reshape(-1),
        hidden_size,
        top_k,
        num_experts,
        out.stride(0),
        pair_out.stride(0),
        BLOCK=block,
        num_warps=4,
    )


def _w8a8_moe(
    out: torch.Tensor,
    hidden: torch.Tensor,
    x_fp8: Fp8GroupRows | None,
    experts: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict[str, int],
) -> None:
    """W8A8 experts (fused_moe_w8a8): hidden's FP8 rows (x_fp8, else quantized here), align,
    the two FP8 grouped GEMMs, the combine over k."""
    w13, w2, w13_scale, w2_scale = experts
    if x_fp8 is None:
        x_fp8 = Fp8GroupRows(*per_token_group_quant_fp8(hidden))
    check_rows(x_fp8, hidden)
    num_experts = w2.shape[0]
    align = moe_align_block_size(topk_ids, num_experts, config["BLOCK_M"])
    flat_weights = topk_weights.reshape(-1)
    pair_out = w8a8_pair_rows(
        x_fp8, w13, w2, w13_scale, w2_scale, flat_weights, align, topk_ids.shape[1],
        hidden.dtype, config,
    )  # fmt: skip
    _combine(out, pair_out, topk_ids, num_experts)


def _runs_w8a8(
    num_tokens: int,
    device: DeviceProperties | None,
    fp8: bool,
    fp8_activations: bool | None,
    weight_only_path: bool,
) -> bool:
    """Whether a batch runs W8A8: `fp8_activations` when given, else the rule; a caller that
    gives a weight-only path's tiles or limit (config, small_config, small_batch_max_tokens)
    without fp8_activations runs that path, and may not ask for W8A8 beside it."""
    if not fp8:
        if fp8_activations:
            raise ValueError("fp8_activations: W8A8 needs FP8 experts (w13_scale, w2_scale)")
        return False
    if weight_only_path:
        if fp8_activations:
            raise ValueError(
                "fp8_activations: config, small_config and small_batch_max_tokens pick a "
                "weight-only path; W8A8's tiles are w8a8_config"
            )
        return False
    return uses_fp8_activations(num_tokens, device, fp8_activations)


def fused_moe(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate_size, hidden_size]
    w2: torch.Tensor,  # [num_experts, hidden_size, intermediate_size]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32/int64
    config: dict[str, int] | None = None,
    *,
    small_config: dict[str, int] | None = None,
    small_batch_max_tokens: int | None = None,
    w13_scale: torch.Tensor | None = None,  # [num_experts, 2I / 128, H / 128] float32 (FP8)
    w2_scale: torch.Tensor | None = None,  # [num_experts, H / 128, I / 128] float32 (FP8)
    x_fp8: Fp8GroupRows | None = None,  # hidden quantized per token-group of 128 (W8A8)
    fp8_activations: bool | None = None,
    w8a8_config: dict[str, int] | None = None,
) -> torch.Tensor:
    """The mixture of `fused_moe_ref` (`fused_moe_fp8_ref` with scales), [num_tokens, hidden_size]
    in hidden's dtype. FP8 experts run W8A8 (`fused_moe_w8a8_ref`) as `_runs_w8a8` says, on
    `x_fp8` (else quantizing hidden) with `w8a8_config`, else tuned/rule tiles. Otherwise the
    small-batch path runs up to small_batch_max_tokens (default SMALL_BATCH_MAX_TOKENS; 0 when a
    grouped `config` is given); tiles from the tuned files, else the device's rule;
    `small_config` overrides the small path's. A pair whose expert id is outside
    [0, num_experts) (another rank's) adds zero."""
    check_moe_inputs(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, hidden_size = hidden.shape
    num_experts, _, inter = w2.shape
    top_k = topk_ids.shape[1]
    device = device_properties(hidden.device)
    fp8 = w13_scale is not None and w2_scale is not None
    weight_only_path = (config, small_config, small_batch_max_tokens) != (None, None, None)
    w8a8 = _runs_w8a8(num_tokens, device, fp8, fp8_activations, weight_only_path)
    if w8a8_config is not None:  # refused before any launch
        check_w8a8_config(w8a8_config, "w8a8_config")
    if (x_fp8 is not None or w8a8_config is not None) and not w8a8:
        raise ValueError(
            f"x_fp8, w8a8_config: a batch of {num_tokens} tokens runs weight-only FP8 experts "
            "here (fused_moe_rule.uses_fp8_activations, or a weight-only path's tiles given)"
        )
    if num_tokens * top_k == 0 or inter == 0 or hidden_size == 0:
        return torch.zeros_like(hidden)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if w8a8:
        assert w13_scale is not None and w2_scale is not None
        shape = (num_experts, inter, hidden_size, top_k)
        config = w8a8_config or w8a8_configs(num_tokens, *shape, device)
        experts = (w13, w2, w13_scale, w2_scale)
        _w8a8_moe(out, hidden, x_fp8, experts, topk_weights, topk_ids, config)
        return out
    if small_batch_max_tokens is None:
        small_batch_max_tokens = SMALL_BATCH_MAX_TOKENS if config is None else 0
    tuned_grouped, tuned_small = moe_configs(
        num_tokens, num_experts, inter, hidden_size, top_k, device, fp8=fp8
    )
    flat_weights = topk_weights.reshape(-1)
    if num_tokens <= small_batch_max_tokens:
        flat_ids = topk_ids.reshape(-1)
        small_config = small_config if small_config is not None else tuned_small
        small_batch_moe(
            out, hidden, w13, w2, flat_weights, flat_ids, top_k, small_config, w13_scale, w2_scale
        )
    else:
        config = config if config is not None else tuned_grouped
        _grouped_moe(out, hidden, w13, w2, flat_weights, topk_ids, config, w13_scale, w2_scale)
    return out
