"""Triton top-k MoE router: p = softmax(logits[t]) in fp32, the k largest in descending order
(ties: lowest expert id first), with `renormalize` divided by their sum. One program a token;
sizes depend on (num_tokens, num_experts, top_k) only: CUDA graph safe. Reference:
`fused_moe_ref.select_experts`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels import FLOAT_DTYPES
from ferrum.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

MAX_EXPERTS = 8192


@triton.jit
def _moe_router_kernel(
    topk_weights_ptr,  # [num_tokens, top_k] float32
    topk_ids_ptr,  # [num_tokens, top_k] int32
    logits_ptr,  # [num_tokens, num_experts]
    num_experts,
    top_k,
    stride_lt,
    stride_le,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program t routes token t: top_k rounds of (max, lowest index attaining it, mask it out)."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    logits = tl.load(
        logits_ptr + tok * stride_lt + offs_e * stride_le, mask=e_mask, other=-float("inf")
    ).to(tl.float32)
    num = tl.exp(logits - tl.max(logits, 0))
    probs = num / tl.sum(num, 0)
    # Selection keys: padding and already chosen experts sit at -1, below every probability; NaN
    # (from a NaN logit) at -0.5, so that a NaN row still picks k distinct valid experts, in
    # index order, and reports their NaN weights.
    keys = tl.where(e_mask, tl.where(probs == probs, probs, -0.5), -1.0)
    offs_k = tl.arange(0, BLOCK_K)
    top_weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in range(0, top_k):
        best = tl.max(keys, 0)
        best_id = tl.min(tl.where(keys == best, offs_e, BLOCK_E), 0)
        weight = tl.sum(tl.where(offs_e == best_id, probs, 0.0), 0)
        top_weights = tl.where(offs_k == j, weight, top_weights)
        top_ids = tl.where(offs_k == j, best_id, top_ids)
        keys = tl.where(offs_e == best_id, -1.0, keys)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, 0)
    k_mask = offs_k < top_k
    tl.store(topk_weights_ptr + tok * top_k + offs_k, top_weights, mask=k_mask)
    tl.store(topk_ids_ptr + tok * top_k + offs_k, top_ids, mask=k_mask)


def _check_inputs(router_logits: torch.Tensor, top_k: int) -> None:
    if router_logits.dim() != 2 or router_logits.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"router_logits must be [num_tokens, num_experts] fp16/bf16/fp32, got "
            f"{tuple(router_logits.shape)} {router_logits.dtype}"
        )
    num_experts = router_logits.shape[1]
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(
            f"router_logits num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}"
        )
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def moe_router(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] fp16/bf16/fp32
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (topk_weights [T, k] float32, topk_ids [T, k] int32), weights in descending order:
    softmax (float32) over experts, top-k, renormalised to sum to 1 when `renormalize`."""
    _check_inputs(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    device = router_logits.device
    topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    topk_ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return topk_weights, topk_ids
    block_e = triton.next_power_of_2(num_experts)
    _moe_router_kernel[(num_tokens,)](
        topk_weights,
        topk_ids,
        router_logits,
        num_experts,
        top_k,
        router_logits.stride(0),
        router_logits.stride(1),
        RENORMALIZE=renormalize,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1 if block_e <= 512 else 4,
        **pdl_launch_args(device),
    )
    return topk_weights, topk_ids
