"""The one-row GEMV with the row's LoRA adapter in the same launch: out = x W^T (+ bias) +
round(x A_s^T) B_s^T, s = slot_ptr[0] (-1: none), A [L, S * R, K] and B [L, N, R] the adapter pool
(a merged layer's S shards: a column of shard j reads t's j-th R-wide block; the scaling is in B),
t rounded to B's dtype as the separate expand rounds it. At one row the shrink and expand
launches cost more than their bytes (bench_lora_kernels.py); here they cost a few programs.

Programs 0 .. T-1 each store one (row block, K tile) of t's partial sums into the layer's
scratch, each value and the forward's number (raised as each forward begins) in one 64-bit word:
a reader tells this forward's value from an older one by the word alone. The rest compute
column blocks like gemv.py, load their t words before the K loop and, if any is not yet this
forward's, again after it. The t programs have the lowest ids, so they usually run first; a
column program that reloads MAX_SPINS times computes the t tiles itself (same code and tile)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.gemv import WEIGHT_DTYPES, load_along_k, rows_dot_x
from ferrum.kernels.gemv_config import GemvTile
from ferrum.kernels.lora_expand import check_slices
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

MAX_SPINS = 4096
_LOW = tl.constexpr(0xFFFFFFFF)  # the low 32 bits of a tagged partial
# A tagged partial no forward's number matches (-1 is never raised to: it is reset first).
UNTAGGED = -1 << 32


@triton.jit
def _shrink_tile(
    a_slot, x_ptr, t_ptr, tile, row_blocks, seq, T_ROWS, K, stride_a,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """One t tile: the partial sums of rows block `tile % row_blocks` over K tile
    `tile // row_blocks`, stored tagged with the forward's number (tag << 32 | fp32 bits)."""
    rows = (tile % row_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_tile = tile // row_blocks
    offs_k = tl.arange(0, BLOCK_K)
    k_left = K - k_tile * BLOCK_K
    a_rows = a_slot + tl.minimum(rows, T_ROWS - 1)[:, None].to(tl.int64) * stride_a
    a = load_along_k(a_rows + k_tile * BLOCK_K + offs_k[None, :], offs_k, k_left, EVEN_K)
    x = load_along_k(x_ptr + k_tile * BLOCK_K + offs_k, offs_k, k_left, EVEN_K)
    part = tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    bits = part.to(tl.int32, bitcast=True).to(tl.int64) & _LOW
    packed = (seq.to(tl.int64) << 32) | bits
    # One 64-bit atomic a word (relaxed): a reader sees the old word or the new one, whole.
    tl.atomic_xchg(t_ptr + k_tile * T_ROWS + rows, packed, mask=rows < T_ROWS, sem="relaxed")


@triton.jit
def _load_tagged_t(
    t_ptr, slot, offs_n, RANK, slice1, slice2, T_ROWS,
    K_TILES: tl.constexpr, K_TILES_P2: tl.constexpr, RANK_P2: tl.constexpr,
    NUM_SHARDS: tl.constexpr,
):  # fmt: skip
    """[K_TILES_P2, BLOCK_N, RANK_P2] int64: each column's shard block of t, one K tile's
    tagged partials a plane (0 past the K tiles and the rank, and all 0 without an adapter: no
    load)."""
    shard = tl.zeros(offs_n.shape, dtype=tl.int32)
    if NUM_SHARDS >= 2:
        shard += (offs_n >= slice1).to(tl.int32)
    if NUM_SHARDS == 3:
        shard += (offs_n >= slice2).to(tl.int32)
    offs_r = tl.arange(0, RANK_P2)
    offs_t = tl.arange(0, K_TILES_P2)
    idx = offs_t[:, None, None] * T_ROWS + (shard[:, None] * RANK + offs_r[None, :])[None, :, :]
    mask = (offs_t[:, None, None] < K_TILES) & (offs_r[None, None, :] < RANK) & (slot >= 0)
    # Volatile (not served from L1, not merged with another load): this launch's t programs
    # are storing them.
    return tl.load(t_ptr + idx, mask=mask, other=0, volatile=True)


@triton.jit
def _stale(
    tagged, seq, RANK, K_TILES: tl.constexpr, K_TILES_P2: tl.constexpr, RANK_P2: tl.constexpr
):
    """1 where a partial of `tagged` does not carry this forward's number, else 0."""
    offs_t = tl.arange(0, K_TILES_P2)
    offs_r = tl.arange(0, RANK_P2)
    valid = (offs_t[:, None, None] < K_TILES) & (offs_r[None, None, :] < RANK)
    stale = valid & ((tagged >> 32).to(tl.int32) != seq)
    return tl.max(tl.max(tl.max(stale.to(tl.int32), 2), 1), 0)


@triton.jit
def _current_t(
    tagged, a_slot, x_ptr, t_ptr, seq, offs_n, row_blocks, K, RANK, slice1, slice2, stride_a_row,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, K_TILES: tl.constexpr,
    K_TILES_P2: tl.constexpr, RANK_P2: tl.constexpr, NUM_SHARDS: tl.constexpr,
    MAX_SPINS: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, RANK_P2] fp32: the columns' t, its K tiles' partials summed in order, once every
    one is this forward's (reloaded until then; after MAX_SPINS reloads computed here). Only
    for a row with an adapter (its loads pass slot 0: any slot >= 0)."""
    t_rows = NUM_SHARDS * RANK
    spins = 0
    while (_stale(tagged, seq, RANK, K_TILES, K_TILES_P2, RANK_P2) > 0) & (spins < MAX_SPINS):
        tagged = _load_tagged_t(t_ptr, 0, offs_n, RANK, slice1, slice2, t_rows, K_TILES,
                                K_TILES_P2, RANK_P2, NUM_SHARDS)  # fmt: skip
        spins += 1
    if _stale(tagged, seq, RANK, K_TILES, K_TILES_P2, RANK_P2) > 0:
        # The t programs have not stored them yet (not started, or slow): compute them here.
        for tile in range(0, row_blocks * K_TILES):
            _shrink_tile(a_slot, x_ptr, t_ptr, tile, row_blocks, seq, t_rows, K, stride_a_row,
                         BLOCK_N, BLOCK_K, EVEN_K)  # fmt: skip
        tl.debug_barrier()
        tagged = _load_tagged_t(t_ptr, 0, offs_n, RANK, slice1, slice2, t_rows, K_TILES,
                                K_TILES_P2, RANK_P2, NUM_SHARDS)  # fmt: skip
    return tl.sum((tagged & _LOW).to(tl.int32).to(tl.float32, bitcast=True), 0)


@triton.jit
def _b_rows(b_ptr, slot, safe_n, stride_b_slot, stride_b_n, RANK, RANK_P2: tl.constexpr):
    """[BLOCK_N, RANK_P2]: the columns' rows of the slot's B (zeros without an adapter)."""
    offs_r = tl.arange(0, RANK_P2)
    b_rows = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_b_slot + safe_n[:, None] * stride_b_n
    return tl.load(b_rows + offs_r[None, :], mask=(offs_r[None, :] < RANK) & (slot >= 0), other=0.0)


@triton.jit
def _gemv_lora_kernel(
    out_ptr,  # [1, N]
    x_ptr,  # [1, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N], read when HAS_BIAS
    a_ptr,  # [L, S * RANK, K]
    b_ptr,  # [L, N, RANK]
    slot_ptr,  # [>= 1] int32: the row's adapter slot, -1 for none
    t_ptr,  # [K_TILES, S * RANK] int64: this layer's tagged partials of t
    seq_ptr,  # [1] int32: this forward's number
    N,
    K,
    RANK,
    slice1,  # first column of shard 1 (NUM_SHARDS >= 2)
    slice2,  # first column of shard 2 (NUM_SHARDS == 3)
    stride_wn,
    stride_a_slot,
    stride_a_row,
    stride_b_slot,
    stride_b_n,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    K_TILES_P2: tl.constexpr,
    RANK_P2: tl.constexpr,
    NUM_SHARDS: tl.constexpr,
    MAX_SPINS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    t_rows = NUM_SHARDS * RANK
    row_blocks = tl.cdiv(t_rows, BLOCK_N)
    t_tiles = row_blocks * K_TILES
    # A t program's column block is 0: it reads that tile too, unused (every program loads the
    # same before the wait, then waits at this level).
    offs_n = tl.maximum(pid - t_tiles, 0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Rows past N read row N - 1 again (stores are masked), so full tiles need no load mask.
    safe_n = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_k
    w_ptrs = w_ptr + safe_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # The first weight tile is read before the wait (weights are never written while serving).
    w = load_along_k(w_ptrs, offs_k, K, EVEN_K)
    pdl_wait(USE_PDL)
    slot = tl.load(slot_ptr)
    seq = tl.load(seq_ptr)
    if pid < t_tiles:
        if slot >= 0:
            a_slot = a_ptr + slot.to(tl.int64) * stride_a_slot
            _shrink_tile(a_slot, x_ptr, t_ptr, pid, row_blocks, seq, t_rows, K, stride_a_row,
                         BLOCK_N, BLOCK_K, EVEN_K)  # fmt: skip
        return
    # Issued now, used after the K loop: B's rows, and t as far as it is stored yet (programs
    # that start after the t programs ended find it all, and never wait).
    b = _b_rows(b_ptr, slot, safe_n, stride_b_slot, stride_b_n, RANK, RANK_P2)
    tagged = _load_tagged_t(t_ptr, slot, offs_n, RANK, slice1, slice2, t_rows, K_TILES,
                            K_TILES_P2, RANK_P2, NUM_SHARDS)  # fmt: skip
    out = rows_dot_x(w, w_ptrs, x_ptrs, offs_k, K, BLOCK_K, EVEN_K)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if slot >= 0:
        a_slot = a_ptr + slot.to(tl.int64) * stride_a_slot
        t = _current_t(tagged, a_slot, x_ptr, t_ptr, seq, offs_n, row_blocks, K,
                       RANK, slice1, slice2, stride_a_row, BLOCK_N, BLOCK_K, EVEN_K, K_TILES,
                       K_TILES_P2, RANK_P2, NUM_SHARDS, MAX_SPINS)  # fmt: skip
        t = t.to(b_ptr.dtype.element_ty).to(tl.float32)
        out += tl.sum(t * b.to(tl.float32), 1)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def new_t_scratch(weight: torch.Tensor, tile: GemvTile, shards: int, rank: int) -> torch.Tensor:
    """A layer's tagged partials of t for `gemv_lora` (tags -1: no forward's number), kept by the
    layer from one forward to the next."""
    k_tiles = triton.cdiv(weight.shape[1], tile.BLOCK_K)
    return torch.full((k_tiles, shards * rank), UNTAGGED, dtype=torch.int64, device=weight.device)


def gemv_lora(
    x: torch.Tensor,  # [1, K], stride(1) == 1, W's dtype
    weight: torch.Tensor,  # [N, K] fp16/bf16, stride(1) == 1
    lora_a: torch.Tensor,  # [L, S * R, K], W's dtype
    lora_b: torch.Tensor,  # [L, N, R], W's dtype
    slots: torch.Tensor,  # int32, slots[0] the row's adapter slot (-1: none)
    slice_starts: tuple[int, ...],  # first column of each of the S shards
    tile: GemvTile,
    t_scratch: torch.Tensor,  # this layer's own (new_t_scratch), kept between forwards
    forward_seq: torch.Tensor,  # [1] int32, raised before each forward's first launch
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[1, N] in x's dtype: x @ weight^T + bias + the row's adapter product. Each layer passes
    its own `t_scratch` and is launched at most once per value of `forward_seq`."""
    if weight.dim() != 2 or weight.dtype not in WEIGHT_DTYPES or weight.stride(1) != 1:
        raise ValueError(f"weight: [N, K] fp16/bf16, last dim contiguous, got {weight.dtype}")
    n, k = weight.shape
    if x.shape != (1, k) or x.dtype != weight.dtype or x.stride(1) != 1:
        raise ValueError(f"x: [1, {k}] {weight.dtype}, got {tuple(x.shape)} {x.dtype}")
    check_slices(slice_starts, n)
    shards = len(slice_starts)
    if lora_a.dim() != 3 or lora_b.dim() != 3 or lora_a.shape[2] != k or lora_b.shape[1] != n:
        raise ValueError(f"lora_a [L, S*R, {k}] and lora_b [L, {n}, R] expected")
    rank = lora_b.shape[2]
    if lora_a.shape[1] != shards * rank or lora_a.shape[0] != lora_b.shape[0]:
        raise ValueError(f"lora_a: [{lora_b.shape[0]}, {shards * rank}, {k}] for {shards} shards")
    if lora_a.dtype != weight.dtype or lora_b.dtype != weight.dtype:
        raise ValueError("lora_a and lora_b: the weight's dtype")
    if lora_a.stride(2) != 1 or lora_b.stride(2) != 1:
        raise ValueError("lora_a and lora_b: the last dimension must be contiguous")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias: [{n}], got {tuple(bias.shape)}")
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    k_tiles = triton.cdiv(k, tile.BLOCK_K)
    if t_scratch.shape != (k_tiles, shards * rank) or t_scratch.dtype != torch.int64:
        raise ValueError(f"t_scratch: [{k_tiles}, {shards * rank}] int64 (new_t_scratch)")
    if forward_seq.dtype != torch.int32:
        raise ValueError("forward_seq: int32")
    t_tiles = triton.cdiv(shards * rank, tile.BLOCK_N) * k_tiles
    starts = (*slice_starts[1:], 0, 0)
    _gemv_lora_kernel[(t_tiles + triton.cdiv(n, tile.BLOCK_N),)](
        out, x, weight, weight if bias is None else bias, lora_a, lora_b, slots, t_scratch,
        forward_seq,
        n, k, rank, starts[0], starts[1], weight.stride(0), lora_a.stride(0), lora_a.stride(1),
        lora_b.stride(0), lora_b.stride(1),
        HAS_BIAS=bias is not None, EVEN_K=k % tile.BLOCK_K == 0, BLOCK_N=tile.BLOCK_N,
        BLOCK_K=tile.BLOCK_K, K_TILES=k_tiles,
        K_TILES_P2=triton.next_power_of_2(k_tiles), RANK_P2=triton.next_power_of_2(rank),
        NUM_SHARDS=shards, MAX_SPINS=MAX_SPINS, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl_launch_args(x.device),
    )  # fmt: skip
    return out
