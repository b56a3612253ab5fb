"""Triton dynamic FP8 (e4m3fn) activation quantization, per token-group (128 columns) or per token:
    scale_g = max(amax(|x_g|), AMAX_FLOOR) / FP8_MAX;  q_g = fp8(clamp(x_g / scale_g, FP8 range))
in fp32, the division IEEE (bit-equal to torch's). `quantize_fp8_tile` is the shared math: the FP8
GEMM quantizes its activation tiles with it, and RMSNorm and SiLU-and-mul write `Fp8GroupRows`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-10
GROUP_SIZE = 128
_IN_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TOKEN_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class Fp8GroupRows:
    """Activation rows quantized per token-group of GROUP_SIZE, exactly as
    `per_token_group_quant_fp8` quantizes them: x[r, c] ~= q[r, c] * scales[r, c // GROUP_SIZE]."""

    q: torch.Tensor  # [num_rows, hidden] fp8, contiguous
    scales: torch.Tensor  # [num_rows, hidden // GROUP_SIZE] fp32, contiguous

    def rows(self, rows: slice) -> Fp8GroupRows:
        """A view of the rows `rows` (still contiguous: whole rows)."""
        return Fp8GroupRows(self.q[rows], self.scales[rows])


def empty_group_rows(num_rows: int, hidden: int, device: torch.device) -> Fp8GroupRows:
    """Uninitialised rows for a kernel to fill; hidden must be a multiple of GROUP_SIZE."""
    if hidden % GROUP_SIZE:
        raise ValueError(
            f"hidden size must be a multiple of {GROUP_SIZE} to quantize per group, got {hidden}"
        )
    return Fp8GroupRows(
        torch.empty(num_rows, hidden, dtype=FP8_DTYPE, device=device),
        torch.empty(num_rows, hidden // GROUP_SIZE, dtype=torch.float32, device=device),
    )


@triton.jit
def fp8_scale_of(amax, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """max(amax, AMAX_FLOOR) / FP8_MAX, IEEE-rounded like torch."""
    return tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), tl.full(amax.shape, FP8_MAX, tl.float32))


@triton.jit
def quantize_fp8_tile(x, amax, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """(fp8 codes, fp32 scale) of fp32 x whose rows' abs-max (broadcastable to x) is amax."""
    scale = fp8_scale_of(amax, FP8_MAX, AMAX_FLOOR)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX).to(tl.float8e4nv)
    return q, scale


@triton.jit
def _per_token_group_quant_kernel(
    q_ptr,  # [num_rows, hidden] fp8
    scale_ptr,  # [num_rows, hidden // GROUP] fp32
    x_ptr,  # [num_rows, hidden]
    num_groups,
    stride_x,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
    FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
):
    """Program (r, c): groups [c * GROUPS_PER_PROGRAM, (c + 1) * GROUPS_PER_PROGRAM) of row r."""
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (groups < num_groups)[:, None]
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_fp8_tile(x, tl.max(tl.abs(x), 1)[:, None], FP8_MAX, AMAX_FLOOR)
    tl.store(q_ptr + row * num_groups * GROUP + cols, q, mask=mask)
    tl.store(scale_ptr + row * num_groups + groups[:, None], scale, mask=mask)


@triton.jit
def store_group_quantized(
    q_ptr,  # [num_rows, num_cols] fp8 codes
    scale_ptr,  # [num_rows, num_cols // GROUP] fp32 scales
    row,  # int64: the row of every group, or [NUM_GROUPS] each group's row
    groups,  # [NUM_GROUPS, GROUP] fp32: one group a tile row
    group_ids,  # [NUM_GROUPS] int: each group's index within its row
    num_cols,  # a row's length, a multiple of GROUP
    valid,  # [NUM_GROUPS]: the groups to store
    GROUP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    # Codes a thread stores at once; 0: the compiler's choice. A norm or SiLU row passes 8, the
    # layout of the 16-bit row the codes come from (16, a whole 16-byte store, would move the
    # row between threads through shared memory).
    CODES_A_STORE: tl.constexpr = 0,
):
    """Quantizes groups of rows (the per-token-group pass's math) and stores their codes and
    scales: a norm's or SiLU's groups of one row, the attention's heads of several tokens."""
    amax = tl.max(tl.abs(groups), 1)
    q, _ = quantize_fp8_tile(groups, amax[:, None], FP8_MAX, AMAX_FLOOR)
    group_starts = q_ptr + row * num_cols + group_ids * GROUP
    cols = tl.arange(0, GROUP)
    if CODES_A_STORE:
        cols = tl.max_contiguous(cols, CODES_A_STORE)
    tl.store(group_starts[:, None] + cols[None, :], q, mask=valid[:, None])
    scales = scale_ptr + row * (num_cols // GROUP) + group_ids
    tl.store(scales, fp8_scale_of(amax, FP8_MAX, AMAX_FLOOR), mask=valid)


@triton.jit
def _per_token_quant_kernel(
    q_ptr,  # [num_rows, hidden] fp8
    scale_ptr,  # [num_rows, 1] fp32
    x_ptr,  # [num_rows, hidden]
    hidden,
    stride_x,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
):
    """Program r: one pass for the abs-max of row r, a second to quantize it."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, hidden, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < hidden, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    row_amax = tl.max(amax, 0)
    for start in range(0, hidden, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < hidden, other=0.0).to(tl.float32)
        q, _ = quantize_fp8_tile(x, row_amax, FP8_MAX, AMAX_FLOOR)
        tl.store(q_ptr + row * hidden + offs, q, mask=offs < hidden)
    tl.store(scale_ptr + row, fp8_scale_of(row_amax, FP8_MAX, AMAX_FLOOR))


def _check_input(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.dtype not in _IN_DTYPES or x.stride(1) != 1:
        raise ValueError(
            "x must be [num_rows, hidden] fp16/bf16/fp32 with stride(1) == 1, got "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )


def per_token_group_quant_fp8(
    x: torch.Tensor,  # [num_rows, hidden]
    group_size: int = GROUP_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q [num_rows, hidden] fp8 contiguous, scales [num_rows, hidden // group_size] fp32)
    with x[r, g * group_size + j] ~= q[r, g * group_size + j] * scales[r, g]."""
    _check_input(x)
    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 16, got {group_size}")
    num_rows, hidden = x.shape
    if hidden % group_size:
        raise ValueError(
            f"x hidden size must be a multiple of group_size {group_size}, got {hidden}"
        )
    if hidden == 0:
        raise ValueError("x hidden size must be >= 1, got 0")
    num_groups = hidden // group_size
    q = torch.empty(num_rows, hidden, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scales
    groups_per_program = min(triton.next_power_of_2(num_groups), max(1, 1024 // group_size))
    grid = (num_rows, triton.cdiv(num_groups, groups_per_program))
    _per_token_group_quant_kernel[grid](
        q,
        scales,
        x,
        num_groups,
        x.stride(0),
        GROUP=group_size,
        GROUPS_PER_PROGRAM=groups_per_program,
        FP8_MAX=FP8_MAX,
        AMAX_FLOOR=AMAX_FLOOR,
        num_warps=4,
    )
    return q, scales


def per_token_quant_fp8(
    x: torch.Tensor,  # [num_rows, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q [num_rows, hidden] fp8 contiguous, scales [num_rows, 1] fp32) with
    x[r, c] ~= q[r, c] * scales[r, 0]: one scale per row."""
    _check_input(x)
    num_rows, hidden = x.shape
    if hidden == 0:
        raise ValueError("x hidden size must be >= 1, got 0")
    q = torch.empty(num_rows, hidden, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(num_rows, 1, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scales
    block = min(_TOKEN_BLOCK, triton.next_power_of_2(hidden))
    _per_token_quant_kernel[(num_rows,)](
        q,
        scales,
        x,
        hidden,
        x.stride(0),
        BLOCK=block,
        FP8_MAX=FP8_MAX,
        AMAX_FLOOR=AMAX_FLOOR,
        num_warps=4,
    )
    return q, scales
