"""Argument checks shared by the gated-delta-rule kernels (decode and chunked prefill).

Layouts: q, k `[num_tokens, num_k_heads, k_dim]`, v `[num_tokens, num_v_heads, v_dim]` (each
with stride(-1) == 1, so views into one fused projection output are fine), g and beta
`[num_tokens, num_v_heads]`, state pool `[num_slots, num_v_heads, k_dim, v_dim]` (contiguous).
"""

from __future__ import annotations

import torch

from ferrum.kernels import FLOAT_DTYPES

MAX_HEAD_DIM = 256


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
