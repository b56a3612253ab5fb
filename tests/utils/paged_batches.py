"""Paged-attention test batches: random queries and a scattered block cache, the reference's
output for them, and per-dtype tolerances (tests/kernels/test_paged_attention*.py)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ferrum.kernels.attention_ref import paged_attention_ref

TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Batch:
    """Random queries and cache; each request's blocks are scattered over a shuffled pool and
    block-table entries past the context hold -1."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(seq_lens), max(blocks_per_req) + 2), -1, dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        block_tables[i, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    starts = [0, *itertools.accumulate(query_lens)]
    return Batch(
        query=query.to(device=device, dtype=dtype),
        kv_cache=kv_cache.to(device=device, dtype=dtype),
        block_tables=block_tables.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def reference(b: Batch, scale: float) -> torch.Tensor:
    return paged_attention_ref(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc_cpu, b.seq_lens_cpu, scale
    )


def free_blocks_below_window(b: Batch, window: int, block_size: int) -> None:
    """Points block-table entries wholly below each request's first window at a NaN block, as a
    sliding-window cache that freed them would leave them: reading one poisons the output."""
    used = set(b.block_tables.flatten().tolist())
    nan_block = min(set(range(b.kv_cache.shape[1])) - used)  # make_batch leaves 3 unused
    b.kv_cache[:, nan_block] = float("nan")
    starts = b.query_start_loc_cpu
    for i, seq_len in enumerate(b.seq_lens_cpu):
        q_len = starts[i + 1] - starts[i]
        first_key = max(0, seq_len - q_len - window + 1)
        b.block_tables[i, : first_key // block_size] = nan_block
