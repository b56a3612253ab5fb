"""The batch-invariant kernel set (`batch_invariant=True`): every op gives a row the same bits
whatever else the step holds, whether the row is a decode or part of a prompt chunk, and however
the prompt was chunked or cached. GEMMs (dense, FP8, int4, the experts') run one tile per weight
shape, never chosen by the row count: no GEMV, no cuBLAS (its algorithm follows M), no split-K.
Attention runs the unified kernel alone (no split-KV, no SDPA) at one tile; a query row sums its
keys in BLOCK_N tiles from position 0 (a window's first tile aligned down), so a prompt row and
the same row decoded read the same tiles in the same order; tiles past a row's position leave its
state exactly unchanged (exp2(-inf) = 0). Norms, rotary, activations, the router and the sampler
were already per row. On the torch path (CPU) the references run row by row: a matmul of one row,
attention of one query over exactly its visible keys."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F

from ferrum.kernels.attention_ref import paged_attention_ref
from ferrum.kernels.fused_moe_ref import fused_moe_ref
from ferrum.kernels.int4_ref import dequantize_int4
from ferrum.kernels.interface import Kernels

# One tile for every step of the unified attention kernel: 64 rows (query tokens x the heads
# sharing a KV head), 4 warps.
ATTENTION_BLOCK_M = 64
ATTENTION_NUM_WARPS = 4
# The experts' grouped GEMM, one tile for every batch (the fused-MoE 128-token bucket).
MOE_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}


def batch_invariant_kernels(base: Kernels) -> Kernels:
    """`base` with every batch-dependent op replaced by its batch-invariant form."""
    if base.is_triton:
        return _triton(base)
    return dataclasses.replace(
        base,
        batch_invariant=True,
        dense_linear=row_by_row(F.linear),
        paged_attention=_attention_query_by_query,
        fused_moe=fused_moe_row_by_row,
        fp8_block_linear=row_by_row(base.fp8_block_linear),
        fp8_channel_linear=row_by_row(base.fp8_channel_linear),
        int4_linear=_int4_row_by_row,
    )


def _triton(base: Kernels) -> Kernels:
    from ferrum.kernels.batch_invariant_matmul import invariant_linear
    from ferrum.kernels.fp8_gemm_config import Fp8GemmConfig
    from ferrum.kernels.fp8_linear import (
        block_linear_takes_fp8_rows,
        fp8_block_linear,
        fp8_channel_linear,
    )
    from ferrum.kernels.fused_moe import fused_moe

    fp8_tile = Fp8GemmConfig(
        "triton", "separate", BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_stages=4
    )
    fp8_buckets = {1 << 62: fp8_tile}
    # base.int4_linear stays: its tile follows the weight's shape alone (int4_linear._tile).
    return dataclasses.replace(
        base,
        batch_invariant=True,
        dense_linear=invariant_linear,
        paged_attention=_unified_attention,
        fused_moe=functools.partial(fused_moe, config=MOE_CONFIG),
        fp8_block_linear=functools.partial(fp8_block_linear, buckets=fp8_buckets),
        fp8_block_linear_takes_rows=functools.partial(
            block_linear_takes_fp8_rows, buckets=fp8_buckets
        ),
        fp8_channel_linear=functools.partial(fp8_channel_linear, buckets=fp8_buckets),
    )


def _unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,
    workspace: Any = None,
    sliding_window: int | None = None,
    out_fp8: Any = None,
) -> torch.Tensor:
    """`paged_attention`'s signature; the unified kernel at the one tile (no split-KV)."""
    from ferrum.kernels.paged_attention import paged_attention_unified

    return paged_attention_unified(
        query,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        max_query_len,
        scale,
        out,
        sliding_window=sliding_window,
        block_m=ATTENTION_BLOCK_M,
        num_warps=ATTENTION_NUM_WARPS,
        out_fp8=out_fp8,
    )


def row_by_row(linear: Any) -> Any:
    """`linear(x, *args)` one row of x at a time, each row copied to its own buffer (a BLAS may
    take another path for another alignment)."""

    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        outs = [linear(row.clone(), *args, **kwargs) for row in rows.split(1)]
        if not outs:
            return linear(x, *args, **kwargs)
        return torch.cat(outs).view(*x.shape[:-1], -1)

    return run


def _int4_row_by_row(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    g_idx: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`int4_linear_ref`: the weights dequantized once, then one row at a time."""
    weight = dequantize_int4(packed, scale, zero, g_idx, group_size).to(x.dtype)
    return row_by_row(F.linear)(x, weight, bias)


def fused_moe_row_by_row(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """`fused_moe_ref` one token at a time (its expert matmuls take a row count each)."""
    if hidden.shape[0] == 0:
        return fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids, **kwargs)
    outs = [
        fused_moe_ref(hidden[t : t + 1].clone(), w13, w2, topk_weights[t : t + 1],
                      topk_ids[t : t + 1], **kwargs)
        for t in range(hidden.shape[0])
    ]  # fmt: skip
    return torch.cat(outs)


def _attention_query_by_query(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,
    workspace: None = None,
    sliding_window: int | None = None,
    out_fp8: None = None,
) -> torch.Tensor:
    """Into `out`: each query token alone over exactly the keys it sees, as a decode of it
    would run."""
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_len = starts[i + 1] - starts[i]
        for j in range(q_len):
            token = starts[i] + j
            visible = seq_len - q_len + j + 1
            out[token] = paged_attention_ref(
                query[token : token + 1].clone(),
                kv_cache,
                block_tables[i : i + 1],
                [0, 1],
                [visible],
                scale,
                sliding_window,
            )[0]
    return out
