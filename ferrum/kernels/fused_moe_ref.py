"""Torch reference for the fused mixture-of-experts op: the CPU path and the oracle for Triton.

Expert weights are stacked: `w13[e]` holds expert e's gate rows then its up rows ([2I, H]) and
`w2[e]` its down projection ([H, I]). The activation is SiLU-and-multiply.
"""

from __future__ import annotations

import torch

from ferrum.kernels.activation_ref import silu_and_mul_ref


def fused_moe_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden_size]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate_size, hidden_size]
    w2: torch.Tensor,  # [num_experts, hidden_size, intermediate_size]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] integer expert ids
) -> torch.Tensor:
    """out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u), where e = topk_ids[t, j] and
    (g, u) = split(w13[e] @ hidden[t]). Expert matmuls run in the input dtype; the weighted sum
    accumulates in float32. Returns [num_tokens, hidden_size] in hidden's dtype. A pair whose
    expert id lies outside [0, num_experts) contributes zero (another rank's expert).
    """
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
        x = hidden[token_idx]
        gate_up = torch.matmul(x, w13[expert].t())
        act = silu_and_mul_ref(gate_up)
        y = torch.matmul(act, w2[expert].t())
        weights = topk_weights.reshape(-1)[flat_pos].float()
        out.index_add_(0, token_idx, y.float() * weights[:, None])
    return out.to(hidden.dtype)
