"""Triton RMSNorm and fused residual-add + RMSNorm, rounded like Hugging Face's LlamaRMSNorm:
y = weight * (x / sqrt(mean(x^2) + eps)).to(dtype), statistics in fp32; the fused form first rounds
residual + x to the input dtype and stores it as the new residual. The `*_fp8` forms also write
`Fp8GroupRows` (as `silu_and_mul_fp8`); their sum of squares goes group by group, so their output
may differ from the plain forms' in the last bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES
from ferrum.kernels.fp8_quant import (
    AMAX_FLOOR,
    FP8_MAX,
    GROUP_SIZE,
    Fp8GroupRows,
    empty_group_rows,
    store_group_quantized,
)
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, hidden]
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden], read and written when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    q_ptr,  # [num_rows, hidden] fp8, written when QUANT_GROUP
    scale_ptr,  # [num_rows, hidden // QUANT_GROUP] fp32, written when QUANT_GROUP
    hidden,
    eps,
    stride_out,
    stride_x,
    stride_res,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT_GROUP: tl.constexpr,  # 0: no FP8 rows
    FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program r normalises row r (after residual[r] += x[r] when HAS_RESIDUAL) and, with
    QUANT_GROUP, quantizes the stored row per group: the row is then held as a tile
    [BLOCK // QUANT_GROUP, QUANT_GROUP], one group a row, so no value moves between threads."""
    pdl_launch_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    if QUANT_GROUP:
        group_ids = tl.arange(0, BLOCK // QUANT_GROUP)
        offs = group_ids[:, None] * QUANT_GROUP + tl.arange(0, QUANT_GROUP)[None, :]
    else:
        offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    # Read before the wait: norm weights are never written while serving.
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_ptrs = residual_ptr + row * stride_res + offs
        summed = (x + tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)).to(
            residual_ptr.dtype.element_ty
        )
        tl.store(res_ptrs, summed, mask=mask)
        x = summed.to(tl.float32)
    if QUANT_GROUP:
        sum_sq = tl.sum(tl.sum(x * x, 1), 0)
    else:
        sum_sq = tl.sum(x * x, 0)
    inv_rms = 1.0 / tl.sqrt(sum_sq / hidden + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + offs, y, mask=mask)
    if QUANT_GROUP:
        store_group_quantized(
            q_ptr, scale_ptr, row, y.to(tl.float32), group_ids, hidden,
            group_ids < hidden // QUANT_GROUP, QUANT_GROUP, FP8_MAX, AMAX_FLOOR,
            CODES_A_STORE=8,
        )  # fmt: skip


def _as_rows(t: torch.Tensor, name: str, hidden: int) -> torch.Tensor:
    if t.dim() == 0 or t.shape[-1] != hidden or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be [..., {hidden}] with stride(-1) == 1, got shape {tuple(t.shape)} "
            f"strides {t.stride()}"
        )
    try:
        return t.view(-1, hidden)
    except RuntimeError as e:
        raise ValueError(
            f"{name} leading dims must flatten to rows without a copy, strides {t.stride()}"
        ) from e


def _check_common(x: torch.Tensor, weight: torch.Tensor, eps: float) -> int:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be fp16/bf16/fp32, got {x.dtype}")
    hidden = x.shape[-1] if x.dim() > 0 else 0
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"x hidden size must be in [1, {MAX_HIDDEN}], got {hidden}")
    if weight.shape != (hidden,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(
            f"weight must be contiguous [{hidden}] {x.dtype}, got {tuple(weight.shape)} "
            f"{weight.dtype}"
        )
    if weight.device != x.device:
        raise ValueError(f"weight must be on {x.device}, got {weight.device}")
    if not eps > 0.0:
        raise ValueError(f"eps must be > 0, got {eps}")
    return hidden


def _check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}, {x.device}), got "
            f"{tuple(residual.shape)} {residual.dtype} {residual.device}"
        )


def _launch(
    out: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    rows: Fp8GroupRows | None = None,
) -> None:
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        out,
        x,
        residual if residual is not None else x,
        weight,
        rows.q if rows is not None else x,
        rows.scales if rows is not None else x,
        hidden,
        eps,
        out.stride(0),
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        QUANT_GROUP=GROUP_SIZE if rows is not None else 0,
        FP8_MAX=FP8_MAX,
        AMAX_FLOOR=AMAX_FLOOR,
        num_warps=min(16, max(1, block // 512)),
        **pdl_launch_args(x.device),
    )


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    out: torch.Tensor | None = None,  # [..., hidden], may be x itself
) -> torch.Tensor:
    """Returns out = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), allocating it if None."""
    hidden = _check_common(x, weight, eps)
    x_rows = _as_rows(x, "x", hidden)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must match x ({tuple(x.shape)}, {x.dtype}, {x.device}), got "
            f"{tuple(out.shape)} {out.dtype} {out.device}"
        )
    _launch(_as_rows(out, "out", hidden), x_rows, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., hidden], overwritten with the normalised sum
    residual: torch.Tensor,  # [..., hidden], overwritten with residual + x
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> None:
    """In place: residual = (residual + x).to(dtype); x = rms_norm(residual, weight, eps)."""
    hidden = _check_common(x, weight, eps)
    _check_residual(x, residual)
    x_rows = _as_rows(x, "x", hidden)
    _launch(x_rows, x_rows, _as_rows(residual, "residual", hidden), weight, eps)


def _fp8_rows_for(x: torch.Tensor, hidden: int) -> Fp8GroupRows:
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"x dtype must be fp16/bf16 to quantize to FP8 rows, got {x.dtype}")
    return empty_group_rows(x.numel() // hidden, hidden, x.device)


def rms_norm_fp8(
    x: torch.Tensor,  # [..., hidden] fp16/bf16, hidden a multiple of 128
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, Fp8GroupRows]:
    """`rms_norm(x, weight, eps)` (its sum of squares added group by group: the output may
    differ from rms_norm's in the last bit) and that output's rows quantized per token-group of
    128."""
    hidden = _check_common(x, weight, eps)
    rows = _fp8_rows_for(x, hidden)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_as_rows(out, "out", hidden), _as_rows(x, "x", hidden), None, weight, eps, rows)
    return out, rows


def fused_add_rms_norm_fp8(
    x: torch.Tensor,  # [..., hidden] fp16/bf16, overwritten with the normalised sum
    residual: torch.Tensor,  # [..., hidden], overwritten with residual + x
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> Fp8GroupRows:
    """`fused_add_rms_norm` (in place; the normalised sum may differ from its in the last bit,
    as in rms_norm_fp8), returning the normalised rows quantized per token-group of 128."""
    hidden = _check_common(x, weight, eps)
    _check_residual(x, residual)
    rows = _fp8_rows_for(x, hidden)
    x_rows = _as_rows(x, "x", hidden)
    _launch(x_rows, x_rows, _as_rows(residual, "residual", hidden), weight, eps, rows)
    return rows
