"""The one-row GEMV with the row's LoRA adapter in the same launch: out = x W^T (+ bias) +
round(x A_s^T) B_s^T, s = slot_ptr[0] (-1: none), A [L, S * R, K] and B [L, N, R] the adapter pool
(a merged layer's S shards: a column of shard j reads t's j-th R-wide block; the scaling is in B),
t rounded to B's dtype as the separate expand rounds it. At one row the shrink and expand
launches cost more than their bytes (bench_lora_kernels.py); here they cost a few programs.

Programs 0 .. T-1 store t's row blocks (fp32 scratch) and count on the layer's `sync` words; the
last of them publishes the forward's number (`seq_ptr`, raised once per forward before any
launch) in READY_COPIES flags. The rest compute column blocks like gemv.py, wait for their flag
copy (pid % READY_COPIES: no word is polled by every program) to hold the number, and add their
adapter product. The t programs have the lowest ids, so run first; a column program that polls
MAX_SPINS times anyway computes t itself (same code and tile: same bits): nothing deadlocks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.gemv import WEIGHT_DTYPES, load_along_k
from ferrum.kernels.gemv_config import GemvTile
from ferrum.kernels.gemv_lora_sync import READY_COPIES, SPREAD, SYNC_WORDS
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

MAX_SHARDS = 3
MAX_SPINS = 4096


@triton.jit
def _shrink_block(
    a_ptr, x_ptr, t_ptr, block, T_ROWS, K, stride_a,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """t[block's BLOCK_N rows] = A[those rows] . x in fp32, stored."""
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + tl.minimum(rows, T_ROWS - 1)[:, None].to(tl.int64) * stride_a + offs_k[None, :]
    x_ptrs = x_ptr + offs_k
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = load_along_k(x_ptrs, offs_k, K - k0, EVEN_K)
        a = load_along_k(a_ptrs, offs_k, K - k0, EVEN_K)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    tl.store(t_ptr + rows, tl.sum(acc, 1), mask=rows < T_ROWS)


@triton.jit
def _publish_t(sync_ptr, seq, t_blocks, READY_COPIES: tl.constexpr, SPREAD: tl.constexpr):
    """Counts a t program done (its rows stored); the last resets the count and sets every ready
    flag to this forward's number."""
    # Every thread's rows are stored before the count (one acq_rel atomic after the barrier).
    tl.debug_barrier()
    if tl.atomic_add(sync_ptr, 1, sem="acq_rel", scope="gpu") == t_blocks - 1:
        tl.store(sync_ptr, 0)
        flags = sync_ptr + (1 + tl.arange(0, READY_COPIES)) * SPREAD
        tl.atomic_xchg(flags, tl.full((READY_COPIES,), seq, tl.int32), sem="release", scope="gpu")


@triton.jit
def _wait_for_t(
    flag_ptr, seq, a_slot, x_ptr, t_ptr, t_blocks, t_rows, K, stride_a_row,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MAX_SPINS: tl.constexpr,
):  # fmt: skip
    """Returns once t is stored: published for this forward, or after MAX_SPINS polls computed
    here."""
    ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (ready != seq) & (spins < MAX_SPINS):
        ready = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if ready != seq:
        for block in range(0, t_blocks):
            _shrink_block(a_slot, x_ptr, t_ptr, block, t_rows, K, stride_a_row,
                          BLOCK_N, BLOCK_K, EVEN_K)  # fmt: skip
        tl.debug_barrier()


@triton.jit
def _adapter_columns(
    t_ptr, b_slot, offs_n, safe_n, RANK, slice1, slice2, stride_b_n,
    RANK_P2: tl.constexpr, NUM_SHARDS: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N] fp32: each column's shard block of t (rounded to B's dtype) times its row of B."""
    shard = tl.zeros(offs_n.shape, dtype=tl.int32)
    if NUM_SHARDS >= 2:
        shard += (offs_n >= slice1).to(tl.int32)
    if NUM_SHARDS == 3:
        shard += (offs_n >= slice2).to(tl.int32)
    offs_r = tl.arange(0, RANK_P2)
    r_mask = offs_r[None, :] < RANK
    # L2, not L1: other programs stored t during this launch.
    t = tl.load(
        t_ptr + shard[:, None] * RANK + offs_r[None, :], mask=r_mask, other=0.0,
        cache_modifier=".cg",
    )  # fmt: skip
    b = tl.load(b_slot + safe_n[:, None] * stride_b_n + offs_r[None, :], mask=r_mask, other=0.0)
    t = t.to(b_slot.dtype.element_ty).to(tl.float32)
    return tl.sum(t * b.to(tl.float32), 1)


@triton.jit
def _gemv_lora_kernel(
    out_ptr,  # [1, N]
    x_ptr,  # [1, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N], read when HAS_BIAS
    a_ptr,  # [L, S * RANK, K]
    b_ptr,  # [L, N, RANK]
    slot_ptr,  # [>= 1] int32: the row's adapter slot, -1 for none
    t_ptr,  # [S * RANK] fp32 scratch
    sync_ptr,  # [SYNC_WORDS] int32: this layer's t count (zero between launches), ready flags
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
    RANK_P2: tl.constexpr,
    NUM_SHARDS: tl.constexpr,
    MAX_SPINS: tl.constexpr,
    READY_COPIES: tl.constexpr,
    SPREAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    t_rows = NUM_SHARDS * RANK
    t_blocks = tl.cdiv(t_rows, BLOCK_N)
    if pid < t_blocks:
        pdl_wait(USE_PDL)
        slot = tl.load(slot_ptr)
        if slot >= 0:
            a_slot = a_ptr + slot.to(tl.int64) * stride_a_slot
            _shrink_block(a_slot, x_ptr, t_ptr, pid, t_rows, K, stride_a_row,
                          BLOCK_N, BLOCK_K, EVEN_K)  # fmt: skip
            _publish_t(sync_ptr, tl.load(seq_ptr), t_blocks, READY_COPIES, SPREAD)
        return
    offs_n = (pid - t_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Rows past N read row N - 1 again (stores are masked), so full tiles need no load mask.
    safe_n = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_k
    w_ptrs = w_ptr + safe_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # The first weight tile is read before the wait (weights are never written while serving).
    w = load_along_k(w_ptrs, offs_k, K, EVEN_K)
    pdl_wait(USE_PDL)
    x = load_along_k(x_ptrs, offs_k, K, EVEN_K)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x = load_along_k(x_ptrs, offs_k, K - k0, EVEN_K)
        w = load_along_k(w_ptrs, offs_k, K - k0, EVEN_K)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr)
    if slot >= 0:
        a_slot = a_ptr + slot.to(tl.int64) * stride_a_slot
        flag = sync_ptr + (1 + pid % READY_COPIES) * SPREAD
        _wait_for_t(flag, tl.load(seq_ptr), a_slot, x_ptr, t_ptr, t_blocks, t_rows, K,
                    stride_a_row, BLOCK_N, BLOCK_K, EVEN_K, MAX_SPINS)  # fmt: skip
        b_slot = b_ptr + slot.to(tl.int64) * stride_b_slot
        out += _adapter_columns(t_ptr, b_slot, offs_n, safe_n, RANK, slice1, slice2, stride_b_n,
                                RANK_P2, NUM_SHARDS)  # fmt: skip
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv_lora(
    x: torch.Tensor,  # [1, K], stride(1) == 1, W's dtype
    weight: torch.Tensor,  # [N, K] fp16/bf16, stride(1) == 1
    lora_a: torch.Tensor,  # [L, S * R, K], W's dtype
    lora_b: torch.Tensor,  # [L, N, R], W's dtype
    slots: torch.Tensor,  # int32, slots[0] the row's adapter slot (-1: none)
    slice_starts: tuple[int, ...],  # first column of each of the S shards
    tile: GemvTile,
    sync: torch.Tensor,  # [SYNC_WORDS] int32 of this layer alone (new_sync_words)
    forward_seq: torch.Tensor,  # [1] int32, raised before each forward's first launch
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[1, N] in x's dtype: x @ weight^T + bias + the row's adapter product. Each layer passes
    its own `sync` and is launched at most once per value of `forward_seq`."""
    if weight.dim() != 2 or weight.dtype not in WEIGHT_DTYPES or weight.stride(1) != 1:
        raise ValueError(f"weight: [N, K] fp16/bf16, last dim contiguous, got {weight.dtype}")
    n, k = weight.shape
    if x.shape != (1, k) or x.dtype != weight.dtype or x.stride(1) != 1:
        raise ValueError(f"x: [1, {k}] {weight.dtype}, got {tuple(x.shape)} {x.dtype}")
    shards = len(slice_starts)
    if (
        not 1 <= shards <= MAX_SHARDS
        or slice_starts[0] != 0
        or list(slice_starts) != sorted(set(slice_starts))
    ):
        raise ValueError(f"slice_starts: 0 then increasing columns, at most {MAX_SHARDS}")
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
    t = torch.empty(shards * rank, dtype=torch.float32, device=x.device)
    if sync.shape != (SYNC_WORDS,) or torch.int32 != sync.dtype or torch.int32 != forward_seq.dtype:
        raise ValueError(f"sync: [{SYNC_WORDS}] int32 (new_sync_words), forward_seq: int32")
    t_blocks = triton.cdiv(shards * rank, tile.BLOCK_N)
    starts = (*slice_starts[1:], 0, 0)
    _gemv_lora_kernel[(t_blocks + triton.cdiv(n, tile.BLOCK_N),)](
        out, x, weight, weight if bias is None else bias, lora_a, lora_b, slots, t, sync,
        forward_seq,
        n, k, rank, starts[0], starts[1], weight.stride(0), lora_a.stride(0), lora_a.stride(1),
        lora_b.stride(0), lora_b.stride(1),
        HAS_BIAS=bias is not None, EVEN_K=k % tile.BLOCK_K == 0, BLOCK_N=tile.BLOCK_N,
        BLOCK_K=tile.BLOCK_K, RANK_P2=triton.next_power_of_2(rank), NUM_SHARDS=shards,
        MAX_SPINS=MAX_SPINS, READY_COPIES=READY_COPIES, SPREAD=SPREAD, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl_launch_args(x.device),
    )  # fmt: skip
    return out
