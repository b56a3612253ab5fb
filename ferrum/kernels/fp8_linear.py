"""FP8 linear: out = x @ W^T (+ bias) in x's dtype, the path picked per row count M by the buckets
(fp8_gemm_config): the weight-only GEMV, the fused Triton GEMM, or a dynamic quantization pass (per
token-group of 128 for block weights, per token for per-channel) then the Triton GEMM, cuBLASLt
("scaled_mm": bf16 output, N and K multiples of 16 row-wise or 128 block-wise) or the Hopper wgmma
GEMM (N % 8 == 0, K % 128 == 0); else the bucket's Triton tile. Rows given already quantized
(`Fp8GroupRows`) skip the pass on all paths but the GEMV (`block_linear_takes_fp8_rows`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrum.kernels import cuda_capability
from ferrum.kernels.device_properties import device_properties
from ferrum.kernels.fp8_gemm import w8a8_block_fp8_matmul, w8a8_channel_fp8_matmul
from ferrum.kernels.fp8_gemm_config import Buckets, Fp8GemmConfig, pick
from ferrum.kernels.fp8_gemm_rule import fp8_gemm_buckets
from ferrum.kernels.fp8_gemm_wgmma import w8a8_block_fp8_matmul_wgmma, wgmma_gemm_takes
from ferrum.kernels.fp8_gemv import fp8_gemv
from ferrum.kernels.fp8_quant import (
    FP8_DTYPE,
    GROUP_SIZE,
    Fp8GroupRows,
    per_token_group_quant_fp8,
    per_token_quant_fp8,
)

_ACT_DTYPES = (torch.float16, torch.bfloat16)


def _buckets(scale_format: str, device: torch.device, n: int, k: int) -> Buckets:
    """The tuned buckets of this shape on the GPU (user folder, then fp8_gemm_configs/), else the
    device's rule (fp8_gemm_rule); on the CPU the fixed defaults."""
    return fp8_gemm_buckets(scale_format, n, k, device_properties(device))


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype not in _ACT_DTYPES or x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}] fp16/bf16, got {list(x.shape)} {x.dtype}")
    return x.reshape(-1, k)


def fp8_block_linear(
    x: torch.Tensor,  # [..., K] fp16/bf16
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale_inv: torch.Tensor,  # [ceil(N / 128), K / 128] fp32
    bias: torch.Tensor | None = None,  # [N]
    buckets: Buckets | None = None,
    x_fp8: Fp8GroupRows | None = None,
) -> torch.Tensor:
    """Returns [..., N] in x's dtype: x quantized per token-group of 128, block-scaled GEMM (the
    GEMV bucket: weight-only). `x_fp8`, x's rows already quantized, replaces that quantization
    on every path but the GEMV, which ignores it (see `block_linear_takes_fp8_rows`)."""
    n, k = weight.shape
    x2 = _rows(x, k)
    config = pick(_buckets("block", x.device, n, k) if buckets is None else buckets, x2.shape[0])
    if x_fp8 is not None:
        _check_rows(x_fp8, x2)
    path = _block_path(config, x.device, x.dtype, n, k)
    if path == "gemv":
        out = _gemv(x2, weight, weight_scale_inv, True, config, bias)
    elif path == "scaled_mm":
        out = _block_scaled_mm(x2, weight, weight_scale_inv, x_fp8)
        if bias is not None:
            out += bias
    elif path == "fused" and x_fp8 is None:
        out = w8a8_block_fp8_matmul(x2, weight, weight_scale_inv, x.dtype, config, bias=bias)
    else:  # "wgmma", "separate", or "fused" given the codes its tiles would make (the same tile)
        q, scales = (x_fp8.q, x_fp8.scales) if x_fp8 is not None else per_token_group_quant_fp8(x2)
        if path == "wgmma":
            out = w8a8_block_fp8_matmul_wgmma(
                q, scales, weight, weight_scale_inv, x.dtype, config.BLOCK_M, config.BLOCK_N,
                config.num_warps, config.num_stages, config.UNROLL, bias=bias,
            )  # fmt: skip
        else:
            out = w8a8_block_fp8_matmul(
                q, weight, weight_scale_inv, x.dtype, config, a_scale=scales, bias=bias
            )
    return out.view(*x.shape[:-1], n)


def _gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_scales: bool,
    config: Fp8GemmConfig,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return fp8_gemv(
        x,
        weight,
        weight_scale,
        x.dtype,
        block_scales,
        config.BLOCK_N,
        config.BLOCK_K,
        config.num_warps,
        config.num_stages,
        bias=bias,
    )


def _check_rows(x_fp8: Fp8GroupRows, x: torch.Tensor) -> None:
    m, k = x.shape
    q, scales = x_fp8.q, x_fp8.scales
    if (
        q.shape != (m, k)
        or scales.shape != (m, k // GROUP_SIZE)
        or q.dtype != FP8_DTYPE
        or scales.dtype != torch.float32
        or not (q.is_contiguous() and scales.is_contiguous())
        or {q.device, scales.device} != {x.device}
    ):
        raise ValueError(
            f"x_fp8 must hold x's [{m}, {k}] rows: contiguous {FP8_DTYPE} codes [{m}, {k}] and "
            f"float32 scales [{m}, {k // GROUP_SIZE}] on {x.device}, got {list(q.shape)} "
            f"{q.dtype} and {list(scales.shape)} {scales.dtype}"
        )


def block_scaled_mm_takes(device: torch.device, dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether cuBLASLt's 1x128 x 128x128 block-scaled GEMM serves x [M, K] @ W[N, K]^T for x of
    this dtype on this device."""
    return (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and n % 128 == 0
        and k % 128 == 0
        and hasattr(F, "scaled_mm")
        and cuda_capability(device.index) == (9, 0)
    )


def _block_path(
    config: Fp8GemmConfig, device: torch.device, dtype: torch.dtype, n: int, k: int
) -> str:
    """What runs a block-scaled bucket: "gemv", "scaled_mm" (where cuBLASLt takes the operands),
    "wgmma" (where the Hopper kernel does), "fused" (the Triton GEMM quantizing its own tiles) or
    "separate" (a quantization pass, then the Triton GEMM)."""
    if config.backend == "gemv":
        return "gemv"
    if config.backend == "scaled_mm" and block_scaled_mm_takes(device, dtype, n, k):
        return "scaled_mm"
    if config.backend == "wgmma" and wgmma_gemm_takes(device, dtype, n, k):
        return "wgmma"
    return "fused" if config.quant == "fused" else "separate"


def block_linear_takes_fp8_rows(
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    k: int,
    num_rows: int,
    buckets: Buckets | None = None,
) -> bool:
    """Whether `fp8_block_linear` of num_rows rows of this dtype on this device reads `x_fp8` in
    place of quantizing x: every bucket but the weight-only GEMV. The answer therefore varies with
    num_rows only through the GEMV buckets (one row in every shipped tuned file and in the
    defaults), so a kernel that writes rows by this answer compiles one variant for all larger
    batches."""
    if device.type != "cuda" or dtype not in _ACT_DTYPES or num_rows == 0:
        return False
    config = pick(_buckets("block", device, n, k) if buckets is None else buckets, num_rows)
    return _block_path(config, device, dtype, n, k) != "gemv"


def _block_scaled_mm(
    x: torch.Tensor,  # [M, K] bf16
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale_inv: torch.Tensor,  # [N / 128, K / 128] fp32
    x_fp8: Fp8GroupRows | None,
) -> torch.Tensor:
    """[M, N] bf16. cuBLASLt wants M padded to 4 and both scales outer-dim-major (column-major
    activation scales [M, K / 128], weight scales given transposed), K blocks padded to 4.
    x_fp8, when given, replaces the quantization of x (padded with zero rows)."""
    m = x.shape[0]
    if x_fp8 is not None:
        q, scales = pad_group_rows(x_fp8, -m % 4)
    else:
        padded = F.pad(x, (0, 0, 0, -m % 4)) if m % 4 else x
        q, scales = per_token_group_quant_fp8(padded)
    num_k_blocks = scales.shape[1]
    w_scale = weight_scale_inv
    if num_k_blocks % 4:
        w_scale = F.pad(w_scale, (0, -num_k_blocks % 4))
    out = F.scaled_mm(
        q,
        weight.t(),
        scales.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        w_scale.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )
    return out[:m]


def pad_group_rows(rows: Fp8GroupRows, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `rows` followed by `pad` zero rows (zero codes, zero scales)."""
    if pad == 0:
        return rows.q, rows.scales
    # The codes pad as bytes: constant padding has no float8 kernel on every torch build.
    q = F.pad(rows.q.view(torch.uint8), (0, 0, 0, pad)).view(rows.q.dtype)
    return q, F.pad(rows.scales, (0, 0, 0, pad))


def scaled_mm_takes(out_dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether torch._scaled_mm's row-wise scaled path serves this GEMM (see module docstring)."""
    return out_dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0


def fp8_channel_linear(
    x: torch.Tensor,  # [..., K] fp16/bf16
    weight: torch.Tensor,  # [N, K] fp8
    weight_scale: torch.Tensor,  # [N, 1] fp32
    bias: torch.Tensor | None = None,  # [N]
    buckets: Buckets | None = None,
) -> torch.Tensor:
    """Returns [..., N] in x's dtype: x quantized per token, per-channel scaled GEMM (the GEMV
    bucket: weight-only)."""
    n, k = weight.shape
    x2 = _rows(x, k)
    config = pick(_buckets("channel", x.device, n, k) if buckets is None else buckets, x2.shape[0])
    if weight_scale.shape != (n, 1) or weight_scale.dtype != torch.float32:
        raise ValueError(
            f"weight_scale must be [{n}, 1] float32, got {list(weight_scale.shape)} "
            f"{weight_scale.dtype}"
        )
    if config.backend == "wgmma":
        raise ValueError("backend 'wgmma' serves block-scaled weights only, not per-channel")
    if config.backend == "gemv":
        out = _gemv(x2, weight, weight_scale, False, config, bias)
    elif config.backend == "scaled_mm" and scaled_mm_takes(x.dtype, n, k):
        q, scales = per_token_quant_fp8(x2)
        out = torch._scaled_mm(
            q, weight.t(), scale_a=scales, scale_b=weight_scale.view(1, n), out_dtype=x.dtype
        )
        if bias is not None:
            out += bias
    elif config.quant == "fused":
        out = w8a8_channel_fp8_matmul(x2, weight, weight_scale, x.dtype, config, bias=bias)
    else:
        q, scales = per_token_quant_fp8(x2)
        out = w8a8_channel_fp8_matmul(
            q, weight, weight_scale, x.dtype, config, a_scale=scales, bias=bias
        )
    return out.view(*x.shape[:-1], n)
