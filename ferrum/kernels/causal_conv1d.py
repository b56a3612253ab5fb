"""Triton short causal depthwise conv1d with per-request conv state (before gated DeltaNet).

For channel c with width-W weight w (fp32 math, one rounding to out's dtype), act SiLU or none:
    y_t = act(bias_c + sum_{j<W} w[c, j] * x_{t - W + 1 + j})
Positions before the sequence read the slot's conv state (the W - 1 previous inputs, oldest first;
zeros where has_initial_state is False); each sequence writes its last W - 1 inputs (older state
rows when shorter) back. As `causal_conv1d_ref`. Slot id < 0: padding (zero output, no state
touched); live slot ids are distinct. State pool: `[num_slots, W - 1, dim]`, channels contiguous."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES
from ferrum.kernels.causal_conv1d_ref import ACTIVATIONS
from ferrum.kernels.varlen_args import check_varlen_args

MAX_WIDTH = 8
_MAX_GRID_YZ = 65535
_BLOCK_T = 32
_BLOCK_D = 128


@triton.jit
def _causal_conv1d_kernel(
    out_ptr,  # [num_tokens, dim]
    x_ptr,  # [num_tokens, dim]
    weight_ptr,  # [dim, WIDTH]
    bias_ptr,  # [dim], read when HAS_BIAS
    state_ptr,  # [num_slots, WIDTH - 1, dim], read and written at the slot
    cu_seqlens_ptr,  # [num_seqs + 1] int32, read when IS_VARLEN (else sequence i is token i)
    slot_ids_ptr,  # [num_seqs] int32
    has_initial_state_ptr,  # [num_seqs] bool, read when HAS_INITIAL_STATE_FLAGS
    dim,
    stride_x_tok,
    stride_o_tok,
    stride_w_dim,
    stride_w_tap,
    stride_state_slot,
    stride_state_row,
    WIDTH: tl.constexpr,
    STATE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_INITIAL_STATE_FLAGS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (t_block, d_block, seq): tokens [t_block * BLOCK_T, +BLOCK_T) of the sequence,
    channels [d_block * BLOCK_D, +BLOCK_D). Only t_block 0 reads the old state (BLOCK_T >=
    WIDTH - 1), so it alone writes the new one, after its reads."""
    t_block = tl.program_id(0)
    d_block = tl.program_id(1)
    seq = tl.program_id(2)
    if IS_VARLEN:
        start = tl.load(cu_seqlens_ptr + seq)
        seq_len = tl.load(cu_seqlens_ptr + seq + 1) - start
    else:
        start = seq
        seq_len = 1
    t0 = t_block * BLOCK_T
    if t0 >= seq_len:
        return
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    t_mask = offs_t < seq_len
    d_mask = offs_d < dim
    out_mask = t_mask[:, None] & d_mask[None, :]
    o_ptrs = out_ptr + (start + offs_t).to(tl.int64)[:, None] * stride_o_tok + offs_d[None, :]
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    if slot < 0:
        tl.store(
            o_ptrs, tl.zeros([BLOCK_T, BLOCK_D], dtype=out_ptr.dtype.element_ty), mask=out_mask
        )
        return
    has_init = True
    if HAS_INITIAL_STATE_FLAGS:
        has_init = tl.load(has_initial_state_ptr + seq) != 0
    state_base = state_ptr + slot * stride_state_slot

    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(WIDTH):
        pos = offs_t - (WIDTH - 1) + j  # relative to the sequence start
        in_x = (pos >= 0)[:, None] & out_mask
        x_ptrs = x_ptr + (start + pos).to(tl.int64)[:, None] * stride_x_tok + offs_d[None, :]
        xv = tl.load(x_ptrs, mask=in_x, other=0.0).to(tl.float32)
        in_state = (pos < 0)[:, None] & out_mask & has_init
        s_ptrs = state_base + (pos + WIDTH - 1)[:, None] * stride_state_row + offs_d[None, :]
        xv += tl.load(s_ptrs, mask=in_state, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + offs_d * stride_w_dim + j * stride_w_tap, mask=d_mask, other=0.0)
        acc += xv * w.to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)

    if t_block == 0:
        # New state row r holds the input at position seq_len - (WIDTH - 1) + r.
        rows = tl.arange(0, STATE_ROWS)
        row_pos = seq_len - (WIDTH - 1) + rows
        row_mask = (rows < WIDTH - 1)[:, None] & d_mask[None, :]
        row_in_x = (row_pos >= 0)[:, None] & row_mask
        row_x_ptrs = (
            x_ptr + (start + row_pos).to(tl.int64)[:, None] * stride_x_tok + offs_d[None, :]
        )
        new_state = tl.load(row_x_ptrs, mask=row_in_x, other=0.0).to(state_ptr.dtype.element_ty)
        row_in_state = (row_pos < 0)[:, None] & row_mask & has_init
        old_ptrs = state_base + (row_pos + WIDTH - 1)[:, None] * stride_state_row + offs_d[None, :]
        new_state += tl.load(old_ptrs, mask=row_in_state, other=0.0)
        tl.debug_barrier()  # every read of the old state precedes the overwrite
        new_ptrs = state_base + rows[:, None] * stride_state_row + offs_d[None, :]
        tl.store(new_ptrs, new_state, mask=row_mask)


def _check_weights(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor,
) -> tuple[int, int]:
    """Checks x and the layer's weight, bias and conv state pool; returns (dim, width)."""
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(
            f"x must be [num_tokens, dim] fp16/bf16/fp32 with stride(1) == 1, got "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    dim = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != dim or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be [{dim}, width] {x.dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )
    width = weight.shape[1]
    if not 2 <= width <= MAX_WIDTH:
        raise ValueError(f"weight width must be in [2, {MAX_WIDTH}], got {width}")
    if bias is not None and (
        bias.shape != (dim,) or bias.dtype != x.dtype or not bias.is_contiguous()
    ):
        raise ValueError(
            f"bias must be contiguous [{dim}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )
    if (
        conv_state_pool.dim() != 3
        or conv_state_pool.shape[1:] != (width - 1, dim)
        or conv_state_pool.dtype != x.dtype
        or conv_state_pool.stride(2) != 1
    ):
        raise ValueError(
            f"conv_state_pool must be [num_slots, {width - 1}, {dim}] {x.dtype} with "
            f"stride(2) == 1, got {tuple(conv_state_pool.shape)} {conv_state_pool.dtype} "
            f"strides {conv_state_pool.stride()}"
        )
    return dim, width


def _check_batch_args(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    activation: str | None,
    out: torch.Tensor,
    num_seqs: int,
    max_seq_len: int,
) -> None:
    """Checks the batch's slot ids, out, the activation, the sizes and every tensor's device."""
    if slot_ids.shape != (num_seqs,) or slot_ids.dtype != torch.int32:
        raise ValueError(
            f"slot_ids must be int32 [{num_seqs}], got {tuple(slot_ids.shape)} {slot_ids.dtype}"
        )
    if out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(
            f"out must match x ({tuple(x.shape)}, {x.dtype}) with stride(1) == 1, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if num_seqs > _MAX_GRID_YZ:
        raise ValueError(f"the number of sequences must be <= {_MAX_GRID_YZ}, got {num_seqs}")
    for t in (weight, conv_state_pool, slot_ids, out) + ((bias,) if bias is not None else ()):
        if t.device != x.device:
            raise ValueError(f"all tensors must be on {x.device}, got one on {t.device}")
    if not 0 <= max_seq_len <= max(x.shape[0], 1):
        raise ValueError(f"max_seq_len must be in [0, num_tokens={x.shape[0]}], got {max_seq_len}")


def _check_and_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state_pool: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor | None,
    activation: str | None,
    out: torch.Tensor,
    num_seqs: int,
    max_seq_len: int,
) -> None:
    """Raises ValueError naming the first malformed argument, else launches the kernel."""
    dim, width = _check_weights(x, weight, bias, conv_state_pool)
    _check_batch_args(
        x, weight, bias, conv_state_pool, slot_ids, activation, out, num_seqs, max_seq_len
    )
    if num_seqs == 0 or x.shape[0] == 0 or max_seq_len == 0:
        return
    block_t = 1 if cu_seqlens is None else _BLOCK_T
    block_d = min(_BLOCK_D, triton.next_power_of_2(dim))
    grid = (triton.cdiv(max_seq_len, block_t), triton.cdiv(dim, block_d), num_seqs)
    _causal_conv1d_kernel[grid](
        out,
        x,
        weight,
        bias if bias is not None else weight,
        conv_state_pool,
        cu_seqlens if cu_seqlens is not None else slot_ids,
        slot_ids,
        has_initial_state if has_initial_state is not None else slot_ids,
        dim,
        x.stride(0),
        out.stride(0),
        weight.stride(0),
        weight.stride(1),
        conv_state_pool.stride(0),
        conv_state_pool.stride(1),
        WIDTH=width,
        STATE_ROWS=triton.next_power_of_2(width - 1),
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        IS_VARLEN=cu_seqlens is not None,
        HAS_INITIAL_STATE_FLAGS=has_initial_state is not None,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        num_warps=4,
    )


def causal_conv1d_prefill(
    x: torch.Tensor,  # [num_tokens, dim]
    weight: torch.Tensor,  # [dim, width]
    bias: torch.Tensor | None,  # [dim]
    conv_state_pool: torch.Tensor,  # [num_slots, width - 1, dim], updated at slot_ids
    cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32
    slot_ids: torch.Tensor,  # [num_seqs] int32; < 0: padding
    max_seq_len: int,
    has_initial_state: torch.Tensor | None = None,  # [num_seqs] bool; None: all True
    *,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,  # [num_tokens, dim]
) -> torch.Tensor:
    """Causal conv over packed sequences from their slots' conv states; returns out.

    `max_seq_len` must be >= every sequence's length (an upper bound is fine: it sizes the grid,
    programs past a sequence's end exit at once)."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_seqs = check_varlen_args(cu_seqlens, has_initial_state, x.device)
    _check_and_launch(
        x,
        weight,
        bias,
        conv_state_pool,
        cu_seqlens,
        slot_ids,
        has_initial_state,
        activation,
        out,
        num_seqs,
        max_seq_len,
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor,  # [num_reqs, dim], one token per request
    weight: torch.Tensor,  # [dim, width]
    bias: torch.Tensor | None,  # [dim]
    conv_state_pool: torch.Tensor,  # [num_slots, width - 1, dim], updated at slot_ids
    slot_ids: torch.Tensor,  # [num_reqs] int32; < 0: padding
    *,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,  # [num_reqs, dim]
) -> torch.Tensor:
    """One decode step per request (token i is request i's): y = conv of the slot's state and
    x, then the state shifts by one input; returns out."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_reqs = x.shape[0] if x.dim() == 2 else 0
    _check_and_launch(
        x, weight, bias, conv_state_pool, None, slot_ids, None, activation, out, num_reqs, 1
    )
    return out
