"""Argument checks and launch arguments shared by the gated-delta-rule kernels (decode, prefill).
Layouts: q, k `[num_tokens, num_k_heads, k_dim]`, v `[num_tokens, num_v_heads, v_dim]` (stride(-1)
== 1 each, so views into one fused projection output are fine), g and beta `[num_tokens,
num_v_heads]`, state pool `[num_slots, num_v_heads, k_dim, v_dim]` (contiguous)."""

from __future__ import annotations

from typing import Any

import torch
import triton

from ferrum.kernels import FLOAT_DTYPES

MAX_HEAD_DIM = 256
_MAX_GRID_YZ = 65535


def _check_token_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.shape != shape or t.dtype not in FLOAT_DTYPES or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be {list(shape)} fp16/bf16/fp32 with stride(-1) == 1, got "
            f"{tuple(t.shape)} {t.dtype} strides {t.stride()}"
        )


def check_gated_delta_rule_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    out: torch.Tensor,
    num_seqs: int,
) -> None:
    """Raises ValueError naming the first malformed argument."""
    if v.dim() != 3:
        raise ValueError(f"v must be [num_tokens, num_v_heads, v_dim], got {tuple(v.shape)}")
    num_tokens, num_v_heads, v_dim = v.shape
    if q.dim() != 3 or q.shape[0] != num_tokens:
        raise ValueError(
            f"q must be [{num_tokens}, num_k_heads, k_dim] (num_tokens from v), got "
            f"{tuple(q.shape)}"
        )
    num_k_heads, k_dim = q.shape[1], q.shape[2]
    _check_token_tensor("v", v, (num_tokens, num_v_heads, v_dim))
    _check_token_tensor("q", q, (num_tokens, num_k_heads, k_dim))
    _check_token_tensor("k", k, (num_tokens, num_k_heads, k_dim))
    if num_k_heads < 1 or num_v_heads % num_k_heads:
        raise ValueError(
            f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})"
        )
    for name, dim in (("k_dim", k_dim), ("v_dim", v_dim)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in [1, {MAX_HEAD_DIM}], got {dim}")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype} {k.dtype} {v.dtype}")
    for name, t in (("g", g), ("beta", beta)):
        if (
            t.shape != (num_tokens, num_v_heads)
            or t.dtype not in FLOAT_DTYPES
            or (num_v_heads > 1 and t.stride(1) != 1)
        ):
            raise ValueError(
                f"{name} must be [{num_tokens}, {num_v_heads}] fp16/bf16/fp32 with "
                f"stride(-1) == 1, got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
            )
    if (
        state_pool.dim() != 4
        or state_pool.shape[1:] != (num_v_heads, k_dim, v_dim)
        or state_pool.dtype not in FLOAT_DTYPES
        or not state_pool.is_contiguous()
    ):
        raise ValueError(
            f"state_pool must be contiguous [num_slots, {num_v_heads}, {k_dim}, {v_dim}] "
            f"fp16/bf16/fp32, got {tuple(state_pool.shape)} {state_pool.dtype}"
        )
    if num_seqs > _MAX_GRID_YZ:
        raise ValueError(f"the number of sequences must be <= {_MAX_GRID_YZ}, got {num_seqs}")
    if slot_ids.shape != (num_seqs,) or slot_ids.dtype != torch.int32:
        raise ValueError(
            f"slot_ids must be int32 [{num_seqs}], got {tuple(slot_ids.shape)} {slot_ids.dtype}"
        )
    if out.shape != v.shape or out.dtype != v.dtype or out.stride(-1) != 1:
        raise ValueError(
            f"out must match v ({tuple(v.shape)}, {v.dtype}) with stride(-1) == 1, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    for t in (q, k, g, beta, state_pool, slot_ids, out):
        if t.device != v.device:
            raise ValueError(f"all tensors must be on {v.device}, got one on {t.device}")


def prepare_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    out: torch.Tensor,
    num_seqs: int,
    scale: float | None,
    use_qk_l2norm: bool,
    block_v: int | None,
    num_warps: int | None,
) -> tuple[tuple[int, int, int], tuple[Any, ...], dict[str, Any]]:
    """What both kernels launch with (arguments checked by `check_gated_delta_rule_args`): the
    grid (v_block, v_head, seq), the arguments from `scale` to `stride_state_k`, the keywords."""
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    k_dim = q.shape[2]
    block_k = max(16, triton.next_power_of_2(k_dim))
    if block_v is None:
        block_v = min(64, max(16, triton.next_power_of_2(v_dim)))
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    grid = (triton.cdiv(v_dim, block_v), num_v_heads, num_seqs)
    args = (
        k_dim**-0.5 if scale is None else scale,
        k_dim,
        v_dim,
        *q.stride()[:2],
        *k.stride()[:2],
        *v.stride()[:2],
        *out.stride()[:2],
        g.stride(0),
        beta.stride(0),
        *state_pool.stride()[:3],
    )
    meta = {
        "GROUP": num_v_heads // q.shape[1],
        "BLOCK_K": block_k,
        "BLOCK_V": block_v,
        "USE_QK_L2NORM": use_qk_l2norm,
        "num_warps": num_warps or (4 if block_k * block_v <= 4096 else 8),
    }
    return grid, args, meta
