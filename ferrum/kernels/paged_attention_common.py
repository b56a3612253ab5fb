"""Pieces shared by the paged-attention kernels: the online-softmax KV loop, argument checks, the
per-head FP8 store of the output (`store_fp8_heads`). KV cache per layer: `[2, num_blocks,
block_size, num_kv_heads, head_dim]`; slot s is at block s // block_size, offset s % block_size.
Sliding window W: the query at p sees p - W < k <= p; the kernels never read keys (nor block-table
entries) below their queries' first window, so blocks out of every window may be freed."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES, FP8_KV_DTYPE
from ferrum.kernels.fp8_quant import (
    AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    GROUP_SIZE,
    Fp8GroupRows,
    store_group_quantized,
)

_LOG2E = 1.4426950408889634
# Running max of a row before it has seen a key: finite, so fully masked tiles give exp2 = 0.
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)
# Max grid size along axes 1 and 2 of a CUDA launch.
_MAX_GRID_YZ = 65535
# Decode batches with fewer single-pass programs (num_reqs * num_kv_heads) than this split the
# context across programs, so that small batches still fill the GPU's SMs ...
SPLIT_KV_MAX_PROGRAMS = 256
# ... into about this many programs, at most SPLIT_KV_MAX_SPLITS parts per request ...
SPLIT_KV_TARGET_PROGRAMS = 512
SPLIT_KV_MAX_SPLITS = 32
# ... unless no context can be longer than this (two key tiles: one pass is as fast).
SPLIT_KV_MIN_SEQ_LEN = 128
# An FP8 cache costs a program more work per byte read (widening each key and value), so its
# decode batches split into this many times more programs (more warps in flight on each SM).
SPLIT_KV_FP8_FACTOR = 4


# fp8_quant's constants as Triton globals (a @jit function reads only constexpr globals).
_FP8_MAX: tl.constexpr = tl.constexpr(FP8_MAX)
_AMAX_FLOOR: tl.constexpr = tl.constexpr(AMAX_FLOOR)


@triton.jit
def store_fp8_heads(
    q8_ptr,  # [num_tokens, num_heads * HEAD_DIM] fp8
    q8_scale_ptr,  # [num_tokens, num_heads] fp32
    out,  # [R, HEAD_DIM] fp32: the values of the output rows just stored
    tok,  # [R] each row's token (its row of the output)
    head,  # [R] each row's query head
    row_valid,  # [R]
    num_heads,
    HEAD_DIM: tl.constexpr,
):
    """Output rows quantized per token-group of HEAD_DIM (= 128) columns of the output's
    [num_tokens, num_heads * HEAD_DIM] view: one group a head, so each program quantizes its
    own heads (fp8_quant's `store_group_quantized`)."""
    store_group_quantized(
        q8_ptr, q8_scale_ptr, tok.to(tl.int64), out, head, num_heads * HEAD_DIM, row_valid,
        HEAD_DIM, _FP8_MAX, _AMAX_FLOOR,
    )  # fmt: skip


def check_fp8_out(out_fp8: Fp8GroupRows | None, out: torch.Tensor) -> None:
    """out_fp8, when given, must hold out [num_tokens, num_heads, 128]'s rows per token-group."""
    if out_fp8 is None:
        return
    num_tokens, num_heads, head_dim = out.shape
    if head_dim != GROUP_SIZE:
        raise ValueError(
            f"out_fp8: FP8 rows need head_dim == {GROUP_SIZE} (one group a head), got {head_dim}"
        )
    q, scales = out_fp8.q, out_fp8.scales
    if q.shape != (num_tokens, num_heads * head_dim) or scales.shape != (num_tokens, num_heads):
        raise ValueError(
            f"out_fp8 must be [{num_tokens}, {num_heads * head_dim}] codes and "
            f"[{num_tokens}, {num_heads}] scales, got {list(q.shape)} and {list(scales.shape)}"
        )
    if q.dtype != FP8_DTYPE or scales.dtype != torch.float32:
        raise ValueError(
            f"out_fp8 must be {FP8_DTYPE} codes and float32 scales, got {q.dtype} and "
            f"{scales.dtype}"
        )
    contiguous = q.is_contiguous() and scales.is_contiguous()
    if not contiguous or {q.device, scales.device} != {out.device}:
        raise ValueError(f"out_fp8 must be contiguous and on {out.device}")


def split_kv_max_programs(fp8_cache: bool) -> int:
    """Single-pass programs below which a decode batch splits its contexts."""
    return SPLIT_KV_MAX_PROGRAMS * (SPLIT_KV_FP8_FACTOR if fp8_cache else 1)


@triton.jit
def _attend_kv_range(
    acc,  # [BLOCK_M, HEAD_DIM] fp32, running sum of p * v
    m_i,  # [BLOCK_M] fp32, running max of the scaled scores (log2 domain)
    l_i,  # [BLOCK_M] fp32, running sum of exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM] in the query's dtype
    q_pos,  # [BLOCK_M] int32, context position of each row's token (causal limit)
    kv_lo,
    kv_first,
    kv_hi,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # [max_blocks] int32, this request's row
    kv_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    qk_scale,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
):
    """Online-softmax accumulation of keys at positions [kv_lo, kv_hi) into (acc, m_i, l_i), in
    BLOCK_N tiles from kv_lo; positions below kv_first (>= kv_lo) are never read (a window's
    freed blocks) and count as masked. A row sees key positions <= its q_pos (with WINDOW > 0,
    only those > q_pos - WINDOW); a tile it sees nothing of leaves its state unchanged. An FP8
    cache is widened to fp16 (exact for e4m3, one hardware conversion per pair of values; bf16 has
    none on Hopper) and both products run in fp16: the query is saturated to fp16's +-65504 and
    the probabilities keep fp16's finer rounding. Otherwise the products run in the query's
    dtype."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if k_cache_ptr.dtype.element_ty.is_fp8():
        dot_dtype = tl.float16
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    else:
        dot_dtype = q.dtype
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + offs_n
        in_range = (pos >= kv_first) & (pos < kv_hi)
        block_ids = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0)
        slot_offs = (
            block_ids.to(tl.int64) * stride_cache_block
            + (pos % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        k = tl.load(
            k_cache_ptr + slot_offs[None, :] + offs_d[:, None], mask=in_range[None, :], other=0.0
        ).to(dot_dtype)  # [HEAD_DIM, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = (pos[None, :] <= q_pos[:, None]) & in_range[None, :]
        if WINDOW > 0:
            visible = visible & (pos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + slot_offs[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0
        ).to(dot_dtype)  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


def _check_block_n(block_n: int) -> None:
    """The key tile of the attention kernels: a power of two >= 16 (tl.dot)."""
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")


def _window_constexpr(sliding_window: int | None) -> int:
    """The kernels' WINDOW constexpr: 0 when off, else the window (>= 1) in key positions."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise ValueError(f"sliding_window must be an int or None, got {sliding_window!r}")
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return sliding_window


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_attention_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    if query.dim() != 3 or query.dtype not in FLOAT_DTYPES or query.stride(-1) != 1:
        raise ValueError(
            "query must be [num_tokens, num_heads, head_dim] fp16/bf16/fp32 with stride(-1) == 1, "
            f"got shape {tuple(query.shape)} {query.dtype} strides {query.stride()}"
        )
    num_heads, head_dim = query.shape[1], query.shape[2]
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError(
            "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim] with "
            f"stride(-1) == 1, got shape {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    if kv_cache.dtype not in (query.dtype, FP8_KV_DTYPE):
        raise ValueError(
            f"kv_cache dtype {kv_cache.dtype} must equal query dtype {query.dtype} or be "
            f"{FP8_KV_DTYPE}"
        )
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache head_dim {kv_cache.shape[4]} != query head_dim {head_dim}")
    if not _is_pow2(head_dim) or head_dim < 16 or head_dim > 256:
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if not _is_pow2(block_size):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(
            f"seq_lens must be a contiguous 1-D int32 tensor, got {tuple(seq_lens.shape)} "
            f"{seq_lens.dtype}"
        )
    num_reqs = seq_lens.shape[0]
    if query_start_loc is not None and (
        query_start_loc.shape != (num_reqs + 1,)
        or query_start_loc.dtype != torch.int32
        or not query_start_loc.is_contiguous()
    ):
        raise ValueError(
            f"query_start_loc must be a contiguous int32 tensor of shape [{num_reqs + 1}] "
            f"(num_reqs + 1), got {tuple(query_start_loc.shape)} {query_start_loc.dtype}"
        )
    if (
        block_tables.dim() != 2
        or block_tables.dtype != torch.int32
        or block_tables.shape[0] < num_reqs
        or block_tables.stride(1) != 1
    ):
        raise ValueError(
            f"block_tables must be int32 [>= {num_reqs}, max_blocks] with stride(1) == 1, "
            f"got {tuple(block_tables.shape)} {block_tables.dtype} strides {block_tables.stride()}"
        )
    if num_reqs > _MAX_GRID_YZ:
        raise ValueError(f"num_reqs must be <= {_MAX_GRID_YZ}, got {num_reqs}")
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must match query ({tuple(query.shape)}, {query.dtype}) with stride(-1) == 1, "
            f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    tensors = (kv_cache, block_tables, seq_lens, out) + (
        (query_start_loc,) if query_start_loc is not None else ()
    )
    for t in tensors:
        if t.device != query.device:
            raise ValueError(f"all tensors must be on {query.device}, got one on {t.device}")


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not be rounded to tf32: the fp32 path is the exactness reference.
    return "ieee" if dtype == torch.float32 else "tf32"
