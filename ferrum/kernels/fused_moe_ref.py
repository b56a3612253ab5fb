"""Torch references for the MoE router (`select_experts`) and the fused mixture-of-experts op: the
CPU path and the oracles for Triton. Stacked expert weights: `w13[e]` holds expert e's gate rows
then its up rows ([2I, H]), `w2[e]` its down projection ([H, I]); activation SiLU-and-multiply."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferrum.kernels.activation_ref import silu_and_mul_ref


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax (float32) over experts, top-k, optionally renormalised to sum to 1.
    Returns (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_moe_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate_size, hidden_size]
    w2: torch.Tensor,  # [num_experts, hidden_size, intermediate_size]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] integer expert ids
    *,
    w13_scale: torch.Tensor | None = None,  # FP8 experts' block scales: see fused_moe_fp8_ref
    w2_scale: torch.Tensor | None = None,
    fp8_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u), where e = topk_ids[t, j] and
    (g, u) = split(w13[e] @ hidden[t]). Expert matmuls run in the weights' dtype (the input's,
    or float32 for dequantized FP8 experts) and round to the input dtype; the weighted sum
    accumulates in float32. Returns [num_tokens, hidden_size] in hidden's dtype. A pair whose
    expert id lies outside [0, num_experts) contributes zero (another rank's expert).
    `fp8_rows` (W8A8, fused_moe_w8a8_ref): each expert's input rows and act rows pass through it
    (quantized per token-group and dequantized to fp32) before their matmul."""
    if w13_scale is not None:
        return fused_moe_fp8_ref(
            hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, fp8_rows
        )
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    flat_ids = topk_ids.reshape(-1)
    # One host sync: which experts received any token.
    active_experts = torch.unique(flat_ids).tolist()
    num_experts = w13.shape[0]
    for expert in active_experts:
        if not 0 <= expert < num_experts:
            continue
        flat_pos = torch.nonzero(flat_ids == expert).squeeze(1)
        token_idx = torch.div(flat_pos, top_k, rounding_mode="floor")
        x = hidden[token_idx] if fp8_rows is None else fp8_rows(hidden[token_idx])
        gate_up = torch.matmul(x.to(w13.dtype), w13[expert].t()).to(hidden.dtype)
        act = silu_and_mul_ref(gate_up)
        act = act if fp8_rows is None else fp8_rows(act)
        y = torch.matmul(act.to(w2.dtype), w2[expert].t()).to(hidden.dtype)
        weights = topk_weights.reshape(-1)[flat_pos].float()
        out.index_add_(0, token_idx, y.float() * weights[:, None])
    return out.to(hidden.dtype)


def dequantize_experts(
    w: torch.Tensor,  # [num_experts, N, K] float8_e4m3fn
    scale: torch.Tensor,  # [num_experts, N / 128, K / 128] float32
    dtype: torch.dtype,
) -> torch.Tensor:
    """(w * scale of its 128x128 block).to(dtype), computed in fp32: [num_experts, N, K]."""
    full = scale.float().repeat_interleave(128, 1).repeat_interleave(128, 2)
    return (w.float() * full).to(dtype)


def fused_moe_fp8_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate_size, hidden_size] float8_e4m3fn
    w2: torch.Tensor,  # [num_experts, hidden_size, intermediate_size] float8_e4m3fn
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] integer expert ids
    w13_scale: torch.Tensor,  # [num_experts, 2 * intermediate_size / 128, hidden_size / 128]
    w2_scale: torch.Tensor,  # [num_experts, hidden_size / 128, intermediate_size / 128]
    fp8_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """`fused_moe_ref` over the FP8 experts dequantized per 128x128 block in float32: each
    expert matmul runs in fp32 and rounds to hidden's dtype, as the kernels' do. Without
    `fp8_rows` the activations are not quantized (weight-only FP8 experts)."""
    return fused_moe_ref(
        hidden,
        dequantize_experts(w13, w13_scale, torch.float32),
        dequantize_experts(w2, w2_scale, torch.float32),
        topk_weights,
        topk_ids,
        fp8_rows=fp8_rows,
    )
