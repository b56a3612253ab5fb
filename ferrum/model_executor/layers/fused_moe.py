"""Mixture-of-experts layer: top-k router plus the fused expert op over stacked weights.

Experts are stored stacked: `w13 [E, 2I, H]` (each expert's gate rows, then its up rows) and
`w2 [E, H, I]`. Checkpoints load either per expert (gate / up / down tensors of one expert, copied
into that expert's slice) or already stacked (HF `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

from ferrum.kernels.fused_moe_ref import fused_moe_ref
from ferrum.model_executor.kernel_backend import TritonKernels
from ferrum.model_executor.layers.linear import check_shape, new_parameter, set_weight_loader

# Shard ids of the expert weights: (projection, expert_id) for one expert's tensor, or
# (projection, None) for a tensor holding all experts stacked.
GATE, UP, GATE_UP, DOWN = "gate", "up", "gate_up", "down"


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


MoeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
MoeRouter = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        hidden_act: str,
        kernels: TritonKernels | None,
    ) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(
                f"hidden_act: {hidden_act!r} is not supported for experts; supported: ['silu']"
            )
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be in [1, num_experts={num_experts}], got {top_k}"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        # The reference expert loop asks the host which experts got tokens (no CUDA graphs); the
        # Triton path sizes everything from the token count and is graph safe.
        self._router: MoeRouter = select_experts if kernels is None else kernels.moe_router
        self._kernel: MoeKernel = fused_moe_ref if kernels is None else kernels.fused_moe
        self.w13 = new_parameter(num_experts, 2 * intermediate_size, hidden_size)
        self.w2 = new_parameter(num_experts, hidden_size, intermediate_size)
        experts = range(num_experts)
        set_weight_loader(
            self.w13, self._load_w13, frozenset((p, e) for p in (GATE, UP) for e in experts)
        )
        set_weight_loader(self.w2, self._load_w2, frozenset((DOWN, e) for e in experts))

    def _expert_id(self, expert_id: int | None) -> int | None:
        if expert_id is not None and not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range [0, {self.num_experts})")
        return expert_id

    def _load_w13(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable
    ) -> set[Hashable]:
        proj, expert_id = shard_id  # type: ignore[misc]
        expert_id = self._expert_id(expert_id)
        size = self.intermediate_size
        if proj == GATE_UP and expert_id is None:
            check_shape(param.shape, loaded.shape, "stacked gate_up_proj")
            param.data.copy_(loaded)
            return {(p, e) for p in (GATE, UP) for e in range(self.num_experts)}
        if proj in (GATE, UP) and expert_id is not None:
            target = param.data[expert_id].narrow(0, 0 if proj == GATE else size, size)
            check_shape(target.shape, loaded.shape, f"expert {expert_id} {proj}_proj")
            target.copy_(loaded)
            return {(proj, expert_id)}
        raise ValueError(f"unknown expert shard {shard_id!r} for w13")

    def _load_w2(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable
    ) -> set[Hashable]:
        proj, expert_id = shard_id  # type: ignore[misc]
        expert_id = self._expert_id(expert_id)
        if proj != DOWN:
            raise ValueError(f"unknown expert shard {shard_id!r} for w2")
        if expert_id is None:
            check_shape(param.shape, loaded.shape, "stacked down_proj")
            param.data.copy_(loaded)
            return {(DOWN, e) for e in range(self.num_experts)}
        target = param.data[expert_id]
        check_shape(target.shape, loaded.shape, f"expert {expert_id} down_proj")
        target.copy_(loaded)
        return {(DOWN, expert_id)}

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """hidden: [T, H], router_logits: [T, E] -> [T, H]."""
        topk_weights, topk_ids = self._router(router_logits, self.top_k, self.renormalize)
        return self._kernel(hidden, self.w13, self.w2, topk_weights, topk_ids)
