"""Triton SiLU-and-mul for SwiGLU MLPs: out = silu(gate) * up over a fused [gate | up] input, with
Hugging Face's roundings: silu in fp32 rounded to the input dtype, then the fp32 product rounded.
`silu_and_mul_fp8` also writes the rows quantized per token-group of 128 (`Fp8GroupRows`, bit-equal
to `per_token_group_quant_fp8`) for an FP8 linear layer to read instead of quantizing itself.
"""

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

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [num_tokens, inter]
    x_ptr,  # [num_tokens, 2 * inter]
    q_ptr,  # [num_tokens, inter] fp8, written when QUANT_GROUP
    scale_ptr,  # [num_tokens, inter // QUANT_GROUP] fp32, written when QUANT_GROUP
    inter,
    stride_out,
    stride_x,
    BLOCK: tl.constexpr,
    QUANT_GROUP: tl.constexpr,  # 0: no FP8 rows; else divides BLOCK and inter
    FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (t, c): columns [c * BLOCK, (c + 1) * BLOCK) of token t; with QUANT_GROUP held as
    a tile [BLOCK // QUANT_GROUP, QUANT_GROUP], one group a row."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    if QUANT_GROUP:
        group_ids = tl.program_id(1) * (BLOCK // QUANT_GROUP) + tl.arange(0, BLOCK // QUANT_GROUP)
        offs = group_ids[:, None] * QUANT_GROUP + tl.arange(0, QUANT_GROUP)[None, :]
    else:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + tok * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + tok * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = (act * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok * stride_out + offs, y, mask=mask)
    if QUANT_GROUP:
        store_group_quantized(
            q_ptr, scale_ptr, tok, y.to(tl.float32), group_ids, inter,
            group_ids < inter // QUANT_GROUP, QUANT_GROUP, FP8_MAX, AMAX_FLOOR,
            CODES_A_STORE=8,
        )  # fmt: skip


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * inter]
    out: torch.Tensor | None = None,  # [num_tokens, inter]
) -> torch.Tensor:
    """Returns out[t, i] = silu(x[t, i]) * x[t, inter + i], allocating out if None."""
    return _silu_and_mul(x, out, None)


def silu_and_mul_fp8(
    x: torch.Tensor,  # [num_tokens, 2 * inter] fp16/bf16, inter a multiple of 128
) -> tuple[torch.Tensor, Fp8GroupRows]:
    """`silu_and_mul(x)` and its rows quantized per token-group of 128."""
    if x.dtype not in (torch.float16, torch.bfloat16) or x.dim() != 2:
        raise ValueError(
            f"x must be [num_tokens, 2 * inter] fp16/bf16 to quantize to FP8 rows, got "
            f"{tuple(x.shape)} {x.dtype}"
        )
    rows = empty_group_rows(x.shape[0], x.shape[1] // 2, x.device)
    return _silu_and_mul(x, None, rows), rows


def _silu_and_mul(
    x: torch.Tensor, out: torch.Tensor | None, rows: Fp8GroupRows | None
) -> torch.Tensor:
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1 or x.shape[1] % 2:
        raise ValueError(
            "x must be [num_tokens, 2 * inter] fp16/bf16/fp32 with an even last dim and "
            f"stride(1) == 1, got {tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    if (
        out.shape != (num_tokens, inter)
        or out.dtype != x.dtype
        or out.device != x.device
        or out.stride(1) != 1
    ):
        raise ValueError(
            f"out must be [{num_tokens}, {inter}] {x.dtype} on {x.device} with stride(1) == 1, "
            f"got {tuple(out.shape)} {out.dtype} {out.device} strides {out.stride()}"
        )
    if num_tokens > 0 and inter > 0:
        grid = (num_tokens, triton.cdiv(inter, _BLOCK))
        _silu_and_mul_kernel[grid](
            out,
            x,
            rows.q if rows is not None else out,
            rows.scales if rows is not None else out,
            inter,
            out.stride(0),
            x.stride(0),
            BLOCK=_BLOCK,
            QUANT_GROUP=GROUP_SIZE if rows is not None else 0,
            FP8_MAX=FP8_MAX,
            AMAX_FLOOR=AMAX_FLOOR,
            num_warps=4,
            **pdl_launch_args(x.device),
        )
    return out
