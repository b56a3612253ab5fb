"""Triton W8A8 FP8 (e4m3fn) GEMM: out = A @ W^T (+ bias), fp32 accumulate. W [N, K] FP8 (K
contiguous); A [M, K] FP8 codes with scales, or fp16/bf16/fp32 quantized inside the GEMM with
fp8_quant's math ("fused": one launch, small M). Block scales (a_scale [M, K / 128], w_scale
[ceil(N / 128), K / 128]), each K step of 128:
    acc[m, n] += (sum_k a[m, k] w[n, k]) * a_scale[m, kb] * w_scale[n // 128, kb];
per-channel scales ([M, 1], [N, 1]) apply once after K. Split-K: the last of a tile's programs to
arrive sums the fp32 partials (`split_k_sum.py`, deterministic)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import cuda_capability
from ferrum.kernels.arrival_counters import arrival_counters
from ferrum.kernels.fp8_gemm_config import Fp8GemmConfig
from ferrum.kernels.fp8_quant import (
    AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    GROUP_SIZE,
    fp8_scale_of,
    quantize_fp8_tile,
)
from ferrum.kernels.split_k_sum import arrive, sum_partials

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _block_scale(
    a_s,  # [BLOCK_M] the rows' activation scales of this K group
    w_scale_ptr,
    group,  # the K group's index
    num_k_groups,
    n_block,  # the tile's first column // GROUP
    offs_n,
    mask_n,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """a_scale[m] * w_scale[n // GROUP] of one K group: [BLOCK_M, 1] when BLOCK_N divides GROUP
    (the tile's columns share one weight block, so applying it is one multiply-add an element and
    one scale load), else [BLOCK_M, BLOCK_N]."""
    if GROUP % BLOCK_N == 0:
        scale = (a_s * tl.load(w_scale_ptr + n_block * num_k_groups + group))[:, None]
    else:
        w_s = tl.load(w_scale_ptr + (offs_n // GROUP) * num_k_groups + group, mask=mask_n)
        scale = a_s[:, None] * w_s[None, :]
    return scale


@triton.jit
def _fp8_gemm_kernel(
    out_ptr,  # [M, N]
    a_ptr,  # [M, K] fp8 when A_FP8, else fp16/bf16/fp32
    a_scale_ptr,  # [M, K // GROUP] (BLOCK_SCALES) or [M, 1] fp32, read when A_FP8
    w_ptr,  # [N, K] fp8
    w_scale_ptr,  # [ceil(N / GROUP), K // GROUP] (BLOCK_SCALES) or [N, 1] fp32
    bias_ptr,  # [N], read when HAS_BIAS
    partial_ptr,  # [num_tiles, SPLIT_K, BLOCK_M, BLOCK_N] fp32, used when SPLIT_K > 1
    counter_ptr,  # [>= num_tiles] int32, zero between launches, used when SPLIT_K > 1
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_om,
    BLOCK_SCALES: tl.constexpr,
    A_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Program (p, s): K steps s * steps_per_split onwards of the [BLOCK_M, BLOCK_N] output tile
    at (pid_m, pid_n), GROUP_M row tiles per column sweep so that neighbouring programs share W
    tiles in L2. With BLOCK_SCALES, BLOCK_K == GROUP and K % GROUP == 0 (one scale column per K
    step)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_first_m = (pid // (GROUP_M * num_pid_n)) * GROUP_M
    group_rows = min(num_pid_m - group_first_m, GROUP_M)
    pid_m = group_first_m + (pid % (GROUP_M * num_pid_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    # W^T tiles [BLOCK_K, BLOCK_N] read from W [N, K]: K contiguous, as FP8 tensor cores want.
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    num_k_groups = K // GROUP

    row_amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    if not A_FP8 and not BLOCK_SCALES:  # per-token scales need the whole row's abs-max first
        for k in range(0, K, BLOCK_K):
            mask_a = mask_m[:, None] & (offs_k[None, :] < K - k)
            a = tl.load(a_ptrs + k, mask=mask_a, other=0.0).to(tl.float32)
            row_amax = tl.maximum(row_amax, tl.max(tl.abs(a), 1))

    steps_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = split * steps_per_split * BLOCK_K
    k_end = min(K, k_begin + steps_per_split * BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    a_ptrs += k_begin
    w_ptrs += k_begin
    if BLOCK_SCALES:  # BLOCK_K == GROUP divides K: no K masks, one scale column a step
        n_block = (pid_n * BLOCK_N) // GROUP
        for k in range(k_begin, k_end, BLOCK_K):
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
            if A_FP8:
                a_q = a
                a_s = tl.load(a_scale_ptr + offs_m * num_k_groups + k // GROUP, mask=mask_m)
            else:
                a_f = a.to(tl.float32)
                amax = tl.max(tl.abs(a_f), 1)
                a_q, _ = quantize_fp8_tile(a_f, amax[:, None], FP8_MAX, AMAX_FLOOR)
                a_s = fp8_scale_of(amax, FP8_MAX, AMAX_FLOOR)
            scale = _block_scale(
                a_s, w_scale_ptr, k // GROUP, num_k_groups, n_block, offs_n, mask_n, GROUP, BLOCK_N
            )
            acc += tl.dot(a_q, w) * scale
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:
        for k in range(k_begin, k_end, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < K - k), other=0.0)
                w = tl.load(w_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < K - k), other=0.0)
            if A_FP8:
                a_q = a
            else:
                a_q, _ = quantize_fp8_tile(a.to(tl.float32), row_amax[:, None], FP8_MAX, AMAX_FLOOR)
            acc = tl.dot(a_q, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K

    if SPLIT_K > 1:
        partials = partial_ptr + pid.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        if not arrive(acc, partials, counter_ptr + pid, split, SPLIT_K):
            return
        acc = sum_partials(partials, counter_ptr + pid, SPLIT_K, BLOCK_M, BLOCK_N)
    _fp8_gemm_epilogue(
        acc, out_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, offs_m, offs_n, mask_m, mask_n,
        row_amax, stride_om, BLOCK_SCALES, A_FP8, HAS_BIAS, FP8_MAX, AMAX_FLOOR,
    )  # fmt: skip


@triton.jit
def _fp8_gemm_epilogue(
    acc,
    out_ptr,
    a_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    row_amax,
    stride_om,
    BLOCK_SCALES: tl.constexpr,
    A_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
):
    """Stores (acc [* per-token x per-channel scales] [+ bias]) as the output tile."""
    if not BLOCK_SCALES:
        if A_FP8:
            a_s = tl.load(a_scale_ptr + offs_m, mask=mask_m)
        else:
            a_s = fp8_scale_of(row_amax, FP8_MAX, AMAX_FLOOR)
        w_s = tl.load(w_scale_ptr + offs_n, mask=mask_n)
        acc = acc * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


MIN_CUDA_CAPABILITY = (8, 9)


def _check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...], dtypes, device) -> None:
    if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != device:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{name} must be {list(shape)} {names} on {device}, got {list(t.shape)} {t.dtype} "
            f"{t.device}"
        )


def _check_operands(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    a_scale: torch.Tensor | None,
) -> tuple[int, int, int]:
    if a.dim() != 2 or a.dtype not in (FP8_DTYPE,) + _FLOAT_DTYPES or a.stride(1) != 1:
        raise ValueError(
            "a must be [M, K] float8_e4m3fn/fp16/bf16/fp32 with stride(1) == 1, got "
            f"{list(a.shape)} {a.dtype} strides {a.stride()}"
        )
    if (a.dtype == FP8_DTYPE) != (a_scale is not None):
        raise ValueError("a_scale must be given exactly when a is float8_e4m3fn")
    if a.is_cuda and cuda_capability(a.device.index) < MIN_CUDA_CAPABILITY:
        raise ValueError(
            f"FP8 GEMMs need CUDA compute capability >= {MIN_CUDA_CAPABILITY} (Ada, Hopper), "
            f"{a.device} has {cuda_capability(a.device.index)}"
        )
    m, k = a.shape
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE or weight.stride(1) != 1:
        raise ValueError(
            f"weight must be [N, K] float8_e4m3fn with stride(1) == 1, got {list(weight.shape)} "
            f"{weight.dtype} strides {weight.stride()}"
        )
    if weight.shape[1] != k or weight.device != a.device:
        raise ValueError(
            f"weight must be [N, {k}] on {a.device} to match a, got {list(weight.shape)} on "
            f"{weight.device}"
        )
    n = weight.shape[0]
    if k == 0 or n == 0:
        raise ValueError(f"K and N must be >= 1, got K={k} N={n}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be fp16/bf16/fp32, got {out_dtype}")
    if bias is not None:
        _check_tensor("bias", bias, (n,), _FLOAT_DTYPES, a.device)
        if not bias.is_contiguous():
            raise ValueError("bias must be contiguous")
    return m, n, k


def check_fp8_operands(
    a: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,
    block_scales: bool,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    a_scale: torch.Tensor | None = None,
) -> tuple[int, int, int]:
    """(M, N, K) after the checks every FP8 product shares: the operands (`_check_operands`)
    and contiguous fp32 scales, with block_scales weight_scale_inv [ceil(N / 128), K / 128] (K a
    multiple of 128) and a_scale [M, K / 128], else weight_scale [N, 1] and a_scale [M, 1]."""
    m, n, k = _check_operands(a, weight, bias, out_dtype, a_scale)
    if block_scales:
        if k % GROUP_SIZE:
            raise ValueError(f"K must be a multiple of {GROUP_SIZE} for block scales, got {k}")
        name, scale_shape = "weight_scale_inv", (-(-n // GROUP_SIZE), k // GROUP_SIZE)
    else:
        name, scale_shape = "weight_scale", (n, 1)
    _check_tensor(name, weight_scale, scale_shape, (torch.float32,), a.device)
    if a_scale is not None:
        a_scale_shape = (m, scale_shape[1]) if block_scales else (m, 1)
        _check_tensor("a_scale", a_scale, a_scale_shape, (torch.float32,), a.device)
    for label, t in ((name, weight_scale), ("a_scale", a_scale)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{label} must be contiguous")
    return m, n, k


def _launch(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8GemmConfig,
    block_scales: bool,
) -> torch.Tensor:
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    num_tiles = triton.cdiv(m, config.BLOCK_M) * triton.cdiv(n, config.BLOCK_N)
    if config.SPLIT_K > 1:
        partials = torch.empty(
            num_tiles * config.SPLIT_K * config.BLOCK_M * config.BLOCK_N,
            dtype=torch.float32,
            device=a.device,
        )
        counters = arrival_counters(a.device, num_tiles, "split-K FP8 GEMM")
    else:
        partials = counters = w_scale
    _fp8_gemm_kernel[(num_tiles, config.SPLIT_K)](
        out,
        a,
        a_scale if a_scale is not None else w_scale,
        weight,
        w_scale,
        bias if bias is not None else w_scale,
        partials,
        counters,
        m,
        n,
        k,
        a.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_SCALES=block_scales,
        A_FP8=a_scale is not None,
        HAS_BIAS=bias is not None,
        EVEN_K=k % config.BLOCK_K == 0,
        GROUP=GROUP_SIZE,
        FP8_MAX=FP8_MAX,
        AMAX_FLOOR=AMAX_FLOOR,
        BLOCK_M=config.BLOCK_M,
        BLOCK_N=config.BLOCK_N,
        BLOCK_K=config.BLOCK_K,
        GROUP_M=config.GROUP_M,
        SPLIT_K=config.SPLIT_K,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def w8a8_block_fp8_matmul(
    a: torch.Tensor,  # [M, K] fp8 with a_scale, or fp16/bf16/fp32 (quantized per group here)
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale_inv: torch.Tensor,  # [ceil(N / 128), K / 128] fp32
    out_dtype: torch.dtype,
    config: Fp8GemmConfig,
    a_scale: torch.Tensor | None = None,  # [M, K / 128] fp32, exactly when a is fp8
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Returns out [M, N] of out_dtype: the block-scaled product (module docstring). K must be a
    multiple of 128 (the activation groups and weight blocks align); N is free (edge blocks)."""
    check_fp8_operands(a, weight, weight_scale_inv, True, bias, out_dtype, a_scale)
    if config.BLOCK_K != GROUP_SIZE:
        raise ValueError(
            f"config.BLOCK_K must be {GROUP_SIZE} for block scales, got {config.BLOCK_K}"
        )
    return _launch(a, a_scale, weight, weight_scale_inv, bias, out_dtype, config, True)


def w8a8_channel_fp8_matmul(
    a: torch.Tensor,  # [M, K] fp8 with a_scale, or fp16/bf16/fp32 (quantized per token here)
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N, 1] fp32
    out_dtype: torch.dtype,
    config: Fp8GemmConfig,
    a_scale: torch.Tensor | None = None,  # [M, 1] fp32, exactly when a is fp8
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Returns out [M, N] of out_dtype: the per-token x per-channel scaled product (module
    docstring). Any M, N, K >= 1."""
    check_fp8_operands(a, weight, weight_scale, False, bias, out_dtype, a_scale)
    return _launch(a, a_scale, weight, weight_scale, bias, out_dtype, config, False)
