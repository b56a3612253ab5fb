"""Triton RMSNorm and fused residual-add + RMSNorm, rounded like Hugging Face's LlamaRMSNorm.

y = weight * (x / sqrt(mean(x^2) + eps)).to(dtype): statistics in fp32, the normalised row
rounded to the input dtype before the weight multiply (one rounding of the product). The fused
form first rounds residual + x to the input dtype, stores it as the new residual, then normalises it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [num_rows, hidden]
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden], read and written when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    hidden,
    eps,
    stride_out,
    stride_x,
    stride_res,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program r normalises row r (after residual[r] += x[r] when HAS_RESIDUAL)."""
    pdl_launch_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
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
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(
        out_ptr + row * stride_out + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask
    )


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


def _launch(
    out: torch.Tensor,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
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
        hidden,
        eps,
        out.stride(0),
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
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
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}, {x.device}), got "
            f"{tuple(residual.shape)} {residual.dtype} {residual.device}"
        )
    x_rows = _as_rows(x, "x", hidden)
    _launch(x_rows, x_rows, _as_rows(residual, "residual", hidden), weight, eps)
