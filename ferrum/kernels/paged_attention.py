"""Triton paged attention over the block-table KV cache, and the KV-cache write.

KV cache layout, per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (index 0 keys,
1 values); slot s lives at block `s // block_size`, offset `s % block_size`.

Two attention paths, same math as `paged_attention_ref`:
- unified: one launch for mixed batches (prompt chunks over a cached prefix plus decodes). A
  program owns one KV head group and a tile of one request's query tokens; its rows are
  (token, query head of the group) pairs, so each KV tile is loaded once per group.
- split-KV (decode-only batches): the context is cut into partitions processed by separate
  programs, which write unnormalised partial results to a caller-owned workspace; a second kernel
  combines them with a log-sum-exp reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Running max of a row before it has seen a key: finite, so fully masked tiles give exp2 = 0.
_NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)
# Max grid size along axes 1 and 2 of a CUDA launch.
_MAX_GRID_YZ = 65535
DEFAULT_PARTITION_SIZE = 512
# Decode batches with fewer single-pass programs (num_reqs * num_kv_heads) than this split the
# context across programs, so that small batches still fill the GPU's SMs.
SPLIT_KV_MAX_PROGRAMS = 256


@triton.jit
def _attend_kv_range(
    acc,  # [BLOCK_M, HEAD_DIM] fp32, running sum of p * v
    m_i,  # [BLOCK_M] fp32, running max of the scaled scores (log2 domain)
    l_i,  # [BLOCK_M] fp32, running sum of exp2(score - m_i)
    q,  # [BLOCK_M, HEAD_DIM] in the cache dtype
    q_pos,  # [BLOCK_M] int32, context position of each row's token (causal limit)
    kv_lo,
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
):
    """Online-softmax accumulation of keys at positions [kv_lo, kv_hi) into (acc, m_i, l_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + offs_n
        in_range = pos < kv_hi
        block_ids = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0)
        slot_offs = (
            block_ids.to(tl.int64) * stride_cache_block
            + (pos % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head
        )
        k = tl.load(
            k_cache_ptr + slot_offs[None, :] + offs_d[:, None], mask=in_range[None, :], other=0.0
        )  # [HEAD_DIM, BLOCK_N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        visible = (pos[None, :] <= q_pos[:, None]) & in_range[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + slot_offs[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0
        )  # [BLOCK_N, HEAD_DIM]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (q_tile, kv_head, req): query tokens [q_tile * BLOCK_Q, +BLOCK_Q) of request req.

    Row r is token q_tile * BLOCK_Q + r // GROUP and query head kv_head * GROUP + r % GROUP. The
    token at chunk index j sits at position seq_len - q_len + j and sees keys 0..that position.
    """
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    tok0 = q_tile * BLOCK_Q
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tok0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (tok < q_len)
    q_offs = (q_start + tok).to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(query_ptr + q_offs[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_hi = tl.minimum(seq_len, prefix_len + tok0 + BLOCK_Q)
    acc, m_i, l_i = _attend_kv_range(
        acc,
        m_i,
        l_i,
        q.to(k_cache_ptr.dtype.element_ty),
        prefix_len + tok,
        0,
        kv_hi,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + req.to(tl.int64) * stride_bt_req,
        kv_head,
        stride_cache_block,
        stride_cache_slot,
        stride_cache_head,
        qk_scale,
        BLOCK_N,
        BLOCK_SIZE,
        HEAD_DIM,
        DOT_PRECISION,
    )
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = (q_start + tok).to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(
        out_ptr + o_offs[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


@triton.jit
def _paged_attention_split_kernel(
    partial_out_ptr,  # [max_num_seqs, num_heads, max_partitions, head_dim] fp32
    partial_max_ptr,  # [max_num_seqs, num_heads, max_partitions] fp32
    partial_sum_ptr,  # [max_num_seqs, num_heads, max_partitions] fp32
    query_ptr,  # [num_reqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt_req,
    stride_po_req,
    stride_po_head,
    stride_po_part,
    stride_pm_req,
    stride_pm_head,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (part, kv_head, req) of a decode batch (token i belongs to request i).

    Attends the group's query heads to keys [part * P, min((part + 1) * P, seq_len)) and stores
    acc = sum_k exp2(s_k - m) v_k, m = max_k s_k and l = sum_k exp2(s_k - m), with s the scores
    scaled by scale * log2(e). Partitions past the context store nothing.
    """
    part = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    kv_lo = part * PARTITION_SIZE
    if kv_lo >= seq_len:
        return
    kv_hi = tl.minimum(seq_len, kv_lo + PARTITION_SIZE)

    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    q_offs = req.to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(query_ptr + q_offs[:, None] + offs_d[None, :], mask=row_valid[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_kv_range(
        acc,
        m_i,
        l_i,
        q.to(k_cache_ptr.dtype.element_ty),
        tl.full([BLOCK_M], 0, dtype=tl.int32) + seq_len - 1,
        kv_lo,
        kv_hi,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + req.to(tl.int64) * stride_bt_req,
        kv_head,
        stride_cache_block,
        stride_cache_slot,
        stride_cache_head,
        qk_scale,
        BLOCK_N,
        BLOCK_SIZE,
        HEAD_DIM,
        DOT_PRECISION,
    )
    po_offs = req.to(tl.int64) * stride_po_req + head * stride_po_head + part * stride_po_part
    tl.store(partial_out_ptr + po_offs[:, None] + offs_d[None, :], acc, mask=row_valid[:, None])
    pm_offs = req.to(tl.int64) * stride_pm_req + head * stride_pm_head + part
    tl.store(partial_max_ptr + pm_offs, m_i, mask=row_valid)
    tl.store(partial_sum_ptr + pm_offs, l_i, mask=row_valid)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr,  # [num_reqs, num_heads, head_dim]
    partial_out_ptr,  # [max_num_seqs, num_heads, max_partitions, head_dim] fp32
    partial_max_ptr,  # [max_num_seqs, num_heads, max_partitions] fp32
    partial_sum_ptr,  # [max_num_seqs, num_heads, max_partitions] fp32
    seq_lens_ptr,  # [num_reqs] int32
    stride_o_tok,
    stride_o_head,
    stride_po_req,
    stride_po_head,
    stride_po_part,
    stride_pm_req,
    stride_pm_head,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
):
    """Program (req, head): out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p, M = max_p m_p."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    num_parts = tl.cdiv(seq_len, PARTITION_SIZE)
    pm_base = req.to(tl.int64) * stride_pm_req + head * stride_pm_head
    po_base = req.to(tl.int64) * stride_po_req + head * stride_po_head
    offs_d = tl.arange(0, HEAD_DIM)

    m_max = tl.full([], _NEG_BIG, dtype=tl.float32)
    for p in range(0, num_parts):
        m_max = tl.maximum(m_max, tl.load(partial_max_ptr + pm_base + p))
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    denom = tl.full([], 0.0, dtype=tl.float32)
    for p in range(0, num_parts):
        w = tl.exp2(tl.load(partial_max_ptr + pm_base + p) - m_max)
        denom += w * tl.load(partial_sum_ptr + pm_base + p)
        acc += w * tl.load(partial_out_ptr + po_base + p * stride_po_part + offs_d)
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    o_offs = req.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    num_kv_heads,
    head_dim,
    block_size,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program t: cache[slot_mapping[t]] = (key[t], value[t]); a negative slot is padding."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    cache_offs = (
        (slot // block_size) * stride_cache_block
        + (slot % block_size) * stride_cache_slot
        + offs_h[:, None] * stride_cache_head
        + offs_d[None, :]
    )
    k_offs = tok * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :]
    k = tl.load(key_ptr + k_offs, mask=mask)
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v_offs = tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :]
    v = tl.load(value_ptr + v_offs, mask=mask)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True, slots=True)
class SplitKVWorkspace:
    """Caller-owned fp32 scratch for the split-KV decode path, sized once at start-up.

    Holds partial results for up to `max_num_seqs` decode requests whose contexts span at most
    `partial_out.shape[2]` partitions of `partition_size` keys.
    """

    partial_out: torch.Tensor  # [max_num_seqs, num_heads, max_partitions, head_dim] fp32
    partial_max: torch.Tensor  # [max_num_seqs, num_heads, max_partitions] fp32
    partial_sum: torch.Tensor  # [max_num_seqs, num_heads, max_partitions] fp32
    partition_size: int

    @property
    def max_num_seqs(self) -> int:
        return self.partial_out.shape[0]

    @property
    def max_partitions(self) -> int:
        return self.partial_out.shape[2]


def split_kv_workspace_shapes(
    max_num_seqs: int,
    num_heads: int,
    head_dim: int,
    max_seq_len: int,
    partition_size: int = DEFAULT_PARTITION_SIZE,
) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
    """Shapes of (partial_out, partial_max == partial_sum) for the split-KV workspace."""
    for name, val in (
        ("max_num_seqs", max_num_seqs),
        ("num_heads", num_heads),
        ("head_dim", head_dim),
        ("max_seq_len", max_seq_len),
    ):
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    _check_partition_size(partition_size)
    max_partitions = triton.cdiv(max_seq_len, partition_size)
    return (
        (max_num_seqs, num_heads, max_partitions, head_dim),
        (max_num_seqs, num_heads, max_partitions),
    )


def allocate_split_kv_workspace(
    max_num_seqs: int,
    num_heads: int,
    head_dim: int,
    max_seq_len: int,
    device: torch.device | str,
    partition_size: int = DEFAULT_PARTITION_SIZE,
) -> SplitKVWorkspace:
    """Allocates the workspace for `split_kv_workspace_shapes(...)` on `device`."""
    out_shape, stat_shape = split_kv_workspace_shapes(
        max_num_seqs, num_heads, head_dim, max_seq_len, partition_size
    )
    return SplitKVWorkspace(
        partial_out=torch.empty(out_shape, dtype=torch.float32, device=device),
        partial_max=torch.empty(stat_shape, dtype=torch.float32, device=device),
        partial_sum=torch.empty(stat_shape, dtype=torch.float32, device=device),
        partition_size=partition_size,
    )


def _check_partition_size(partition_size: int) -> None:
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")


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
    if query.dim() != 3 or query.dtype not in _FLOAT_DTYPES or query.stride(-1) != 1:
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
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} must equal query dtype {query.dtype}")
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


def paged_attention_unified(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
) -> torch.Tensor:
    """Single-pass attention for any mix of prompt chunks and decodes; writes and returns `out`.

    `max_query_len` must be >= every request's query length (an upper bound is fine, e.g. for
    CUDA graph capture); tiles past a request's chunk exit at once.
    """
    _check_attention_args(query, kv_cache, block_tables, query_start_loc, seq_lens, out)
    if max_query_len < 0 or max_query_len > max(query.shape[0], 1):
        raise ValueError(
            f"max_query_len must be in [0, num_tokens={query.shape[0]}], got {max_query_len}"
        )
    num_reqs = seq_lens.shape[0]
    if num_reqs == 0 or max_query_len == 0 or query.shape[0] == 0:
        return out
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    # Rows = tokens x group heads; size the tile to the longest chunk (decodes: 16 rows).
    block_m = min(128, max(16, triton.next_power_of_2(max_query_len * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    block_n = 64 if head_dim <= 128 else 32
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (triton.cdiv(max_query_len, block_q), num_kv_heads, num_reqs)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=8 if block_m >= 128 else 4,
    )
    return out


def paged_attention_split_kv(
    query: torch.Tensor,  # [num_reqs, num_heads, head_dim], one decode token per request
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    workspace: SplitKVWorkspace,
) -> torch.Tensor:
    """Split-KV decode attention (token i is request i's only query token); writes `out`.

    `max_seq_len` must be >= every seq_len (an upper bound is fine); it sets the partition grid.
    """
    _check_attention_args(query, kv_cache, block_tables, None, seq_lens, out)
    num_reqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if query.shape[0] != num_reqs:
        raise ValueError(
            f"query must hold one token per request for split-KV: num_tokens {query.shape[0]} "
            f"!= num_reqs {num_reqs}"
        )
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    num_parts = triton.cdiv(max_seq_len, workspace.partition_size)
    if num_reqs > workspace.max_num_seqs:
        raise ValueError(
            f"num_reqs {num_reqs} exceeds workspace max_num_seqs {workspace.max_num_seqs}"
        )
    if num_parts > workspace.max_partitions:
        raise ValueError(
            f"max_seq_len {max_seq_len} needs {num_parts} partitions, workspace has "
            f"{workspace.max_partitions}"
        )
    ws_out, ws_max, ws_sum = workspace.partial_out, workspace.partial_max, workspace.partial_sum
    if (
        ws_out.shape[1] != num_heads
        or ws_out.shape[3] != head_dim
        or ws_out.stride(3) != 1
        or ws_max.shape != ws_out.shape[:3]
        or ws_sum.stride() != ws_max.stride()
        or ws_max.stride(2) != 1
        or any(t.dtype != torch.float32 for t in (ws_out, ws_max, ws_sum))
        or any(t.device != query.device for t in (ws_out, ws_max, ws_sum))
    ):
        raise ValueError(
            "workspace must come from allocate_split_kv_workspace for num_heads="
            f"{num_heads}, head_dim={head_dim} on {query.device}"
        )
    if num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    block_n = 64 if head_dim <= 128 else 32
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_attention_split_kernel[(num_parts, num_kv_heads, num_reqs)](
        ws_out,
        ws_max,
        ws_sum,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        ws_out.stride(0),
        ws_out.stride(1),
        ws_out.stride(2),
        ws_max.stride(0),
        ws_max.stride(1),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        PARTITION_SIZE=workspace.partition_size,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=4,
    )
    _split_kv_reduce_kernel[(num_reqs, num_heads)](
        out,
        ws_out,
        ws_max,
        ws_sum,
        seq_lens,
        out.stride(0),
        out.stride(1),
        ws_out.stride(0),
        ws_out.stride(1),
        ws_out.stride(2),
        ws_max.stride(0),
        ws_max.stride(1),
        HEAD_DIM=head_dim,
        PARTITION_SIZE=workspace.partition_size,
        num_warps=1 if head_dim <= 64 else 2,
    )
    return out


def use_split_kv(
    num_reqs: int,
    num_tokens: int,
    num_kv_heads: int,
    max_query_len: int,
    max_seq_len: int,
    workspace: SplitKVWorkspace | None,
) -> bool:
    """True when a decode-only batch is too small to fill the GPU and its context is long enough
    to span several partitions of the workspace (and fits in it)."""
    if workspace is None or max_query_len != 1 or num_tokens != num_reqs:
        return False
    num_parts = triton.cdiv(max_seq_len, workspace.partition_size)
    return (
        1 < num_parts <= workspace.max_partitions
        and num_reqs <= workspace.max_num_seqs
        and num_reqs * num_kv_heads < SPLIT_KV_MAX_PROGRAMS
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    workspace: SplitKVWorkspace | None = None,
) -> torch.Tensor:
    """Causal paged attention, same contract as `paged_attention_ref`; writes and returns `out`.

    Query token j of request i (chunk length q_i = query_start_loc[i+1] - query_start_loc[i],
    context length L_i = seq_lens[i]) sits at position L_i - q_i + j and attends to context
    positions 0..L_i - q_i + j:  out = softmax(scale * q K^T) V, softmax in fp32.
    Picks the split-KV path for small decode-only batches over long contexts (`use_split_kv`),
    the unified single-pass path otherwise. `max_query_len` / `max_seq_len` are upper bounds.
    """
    num_reqs = seq_lens.shape[0] if seq_lens.dim() == 1 else 0
    num_kv_heads = kv_cache.shape[3] if kv_cache.dim() == 5 else 1
    if use_split_kv(num_reqs, query.shape[0], num_kv_heads, max_query_len, max_seq_len, workspace):
        assert workspace is not None
        return paged_attention_split_kv(
            query, kv_cache, block_tables, seq_lens, max_seq_len, scale, out, workspace
        )
    return paged_attention_unified(
        query, kv_cache, block_tables, query_start_loc, seq_lens, max_query_len, scale, out
    )


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """kv_cache[:, slot_mapping[t]] = (key[t], value[t]) for each token t; slots < 0 are skipped."""
    if key.dim() != 3 or key.stride(-1) != 1 or key.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            "key must be [num_tokens, num_kv_heads, head_dim] float with stride(-1) == 1, got "
            f"{tuple(key.shape)} {key.dtype} strides {key.stride()}"
        )
    if value.shape != key.shape or value.dtype != key.dtype or value.stride(-1) != 1:
        raise ValueError(
            f"value must match key ({tuple(key.shape)}, {key.dtype}) with stride(-1) == 1, got "
            f"{tuple(value.shape)} {value.dtype}"
        )
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or tuple(kv_cache.shape[3:]) != tuple(key.shape[1:])
        or kv_cache.stride(-1) != 1
        or kv_cache.dtype not in _FLOAT_DTYPES
    ):
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {key.shape[1]}, {key.shape[2]}] float "
            f"with stride(-1) == 1, got {tuple(kv_cache.shape)} strides {kv_cache.stride()}"
        )
    if (
        slot_mapping.shape != (key.shape[0],)
        or slot_mapping.dtype != torch.int64
        or not slot_mapping.is_contiguous()
    ):
        raise ValueError(
            f"slot_mapping must be contiguous int64 of shape [{key.shape[0]}] (num_tokens), got "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    for t in (value, kv_cache, slot_mapping):
        if t.device != key.device:
            raise ValueError(f"all tensors must be on {key.device}, got one on {t.device}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        head_dim,
        kv_cache.shape[2],
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
