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

from ferrum.kernels.attention_ref import paged_attention_query_by_query_ref
from ferrum.kernels.fused_moe_ref import fused_moe_ref
from ferrum.kernels.int4_ref import int4_linear_ref
from ferrum.kernels.interface import Kernels, host_paged_attention

# One tile for every step of the unified attention kernel: (BLOCK_M, num_warps), 64 rows (query
# tokens x the heads sharing a KV head) and 4 warps.
ATTENTION_TILE = (64, 4)
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
        paged_attention=host_paged_attention(paged_attention_query_by_query_ref),
        fused_moe=fused_moe_row_by_row,
        fp8_block_linear=row_by_row(base.fp8_block_linear),
        fp8_channel_linear=row_by_row(base.fp8_channel_linear),
        int4_linear=functools.partial(int4_linear_ref, linear=row_by_row(F.linear)),
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
    from ferrum.kernels.paged_attention import paged_attention

    fp8_tile = Fp8GemmConfig(
        "triton", "separate", BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_stages=4
    )
    fp8_buckets = {1 << 62: fp8_tile}
    # base.int4_linear stays: its tile follows the weight's shape alone (int4_linear._tile).
    return dataclasses.replace(
        base,
        batch_invariant=True,
        dense_linear=invariant_linear,
        paged_attention=functools.partial(paged_attention, unified_tile=ATTENTION_TILE),
        fused_moe=functools.partial(fused_moe, config=MOE_CONFIG, fp8_activations=False),
        fp8_block_linear=functools.partial(fp8_block_linear, buckets=fp8_buckets),
        fp8_block_linear_takes_rows=functools.partial(
            block_linear_takes_fp8_rows, buckets=fp8_buckets
        ),
        fp8_channel_linear=functools.partial(fp8_channel_linear, buckets=fp8_buckets),
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
