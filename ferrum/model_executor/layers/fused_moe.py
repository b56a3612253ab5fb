"""Mixture-of-experts layer: top-k router plus the fused expert op over stacked weights `w13`
[E, 2I, H] (gate rows, then up rows) and `w2` [E, H, I], split over tensor-parallel ranks by
intermediate rows or whole experts. Checkpoints load per expert or already stacked (HF
`gate_up_proj`, `down_proj`). A `quant_method` (fp8_moe.py) makes the weights in its format and
runs the experts; its scale parameters' sizes and offsets are in `output_block` blocks."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.kernels.interface import Kernels
from ferrum.model_executor.layers.linear import (
    check_dtype,
    check_shape,
    new_parameter,
    set_weight_loader,
)
from ferrum.model_executor.layers.parallel_linear import split_evenly
from ferrum.model_executor.weight_loader import CheckpointTensor, materialize

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows
    from ferrum.model_executor.layers.quantization.fp8_moe import Fp8MoEMethod
    from ferrum.model_executor.layers.quantization.int4_moe import Int4MoEMethod

Loaded = torch.Tensor | CheckpointTensor

# Shard ids of the expert weights: (projection, expert_id) for one expert's tensor, or
# (projection, None) for a tensor holding all experts stacked.
GATE, UP, GATE_UP, DOWN = "gate", "up", "gate_up", "down"


class FusedMoE(nn.Module):
    """The experts of one MoE block, this rank's share. Tensor parallel (default): every expert,
    intermediate rows [r * I / tp, (r + 1) * I / tp). Expert parallel: experts
    [r * E / tp, (r + 1) * E / tp) whole; other ranks' expert ids become -1 (zero here). Either
    way the partial outputs are all-reduced and loading reads only the rank's share.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        hidden_act: str,
        kernels: Kernels,
        tp_group: TensorParallelGroup | None = None,
        expert_parallel: bool = False,
        quant_method: Fp8MoEMethod | Int4MoEMethod | None = None,
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
        self.tp_group = tp_group or TensorParallelGroup()
        tp, rank = self.tp_group.world_size, self.tp_group.rank
        self.expert_parallel = expert_parallel and tp > 1
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        # The checkpoint's intermediate size and this rank's slice of it.
        self.full_intermediate_size = intermediate_size
        if self.expert_parallel:
            self.num_local_experts = split_evenly(num_experts, tp, "num_experts")
            self.intermediate_size = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.intermediate_size = split_evenly(intermediate_size, tp, "moe_intermediate_size")
        self.expert_start = rank * self.num_local_experts if self.expert_parallel else 0
        self.intermediate_start = 0 if self.expert_parallel else rank * self.intermediate_size
        self.renormalize = renormalize
        # The reference expert loop asks the host which experts got tokens (no CUDA graphs); the
        # Triton kernels size everything from the token count and are graph safe.
        self._router = kernels.moe_router
        self._kernel = kernels.fused_moe
        local, inter = self.num_local_experts, self.intermediate_size
        self.quant_method = quant_method
        if quant_method is None:
            self.w13 = new_parameter(local, 2 * inter, hidden_size)
            self.w2 = new_parameter(local, hidden_size, inter)
        else:
            quant_method.create_weights(self, local, hidden_size, inter)
        experts = range(self.expert_start, self.expert_start + local)
        w13_shards = frozenset((p, e) for p in (GATE, UP) for e in experts)
        w2_shards = frozenset((DOWN, e) for e in experts)
        for name, param in self.named_parameters(recurse=False):
            if name.startswith("w13"):
                set_weight_loader(param, self._load_w13, w13_shards)
            else:
                set_weight_loader(param, self._load_w2, w2_shards)
            # Loaders narrow the checkpoint tensor to this rank's share before reading it.
            param.reads_slices = True  # type: ignore[attr-defined]

    def _local_expert(self, expert_id: int | None) -> int | None:
        """The local index of a global expert id; None when another rank holds it."""
        if expert_id is None:
            return None
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range [0, {self.num_experts})")
        local = expert_id - self.expert_start
        return local if 0 <= local < self.num_local_experts else None

    def _local_experts(self, stacked: Loaded, what: str, shape: tuple[int, ...]) -> Loaded:
        check_shape(torch.Size((self.num_experts, *shape)), stacked.shape, what)
        return stacked.narrow(0, self.expert_start, self.num_local_experts)

    def _sizes(self, param: nn.Parameter, w13: bool) -> tuple[int, int, int, int]:
        """(full intermediate, this rank's start and size in it, hidden) in `param`'s units:
        weight rows (w13's intermediate, w2's hidden: `output_block` of them an entry) and
        columns (`input_block`: packed int4 words, groups; else as rows)."""
        rows = getattr(param, "output_block", 1)
        cols = getattr(param, "input_block", None) or rows
        inter, hidden = (rows, cols) if w13 else (cols, rows)
        sizes = (
            self.full_intermediate_size,
            self.intermediate_start,
            self.intermediate_size,
        )
        if any(size % inter for size in sizes) or self.hidden_size % hidden:
            raise ValueError(
                f"expert parameters cover {inter}-wide blocks of the intermediate size (and "
                f"{hidden} of hidden {self.hidden_size}), but this rank's intermediate slice "
                f"[{self.intermediate_start}, +{self.intermediate_size}) of "
                f"{self.full_intermediate_size} is not block aligned"
            )
        return (*(size // inter for size in sizes), self.hidden_size // hidden)  # type: ignore[return-value]

    def _gate_up_rows(
        self, loaded: Loaded, dim: int, full: int, start: int, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's gate rows and up rows of a [.., 2I, H] tensor (gate rows, then up)."""
        gate = materialize(loaded.narrow(dim, start, size))
        up = materialize(loaded.narrow(dim, full + start, size))
        return gate, up

    def _load_w13(self, param: nn.Parameter, loaded: Loaded, shard_id: Hashable) -> set[Hashable]:
        proj, expert_id = shard_id  # type: ignore[misc]
        check_dtype(param, loaded)
        full, start, size, hidden = self._sizes(param, w13=True)
        if proj == GATE_UP and expert_id is None:
            stacked = self._local_experts(loaded, "stacked gate_up_proj", (2 * full, hidden))
            gate, up = self._gate_up_rows(stacked, 1, full, start, size)
            param.data[:, :size].copy_(gate)
            param.data[:, size:].copy_(up)
            return set(param.shard_ids)  # type: ignore[attr-defined]
        if proj in (GATE, UP) and expert_id is not None:
            check_shape(torch.Size((full, hidden)), loaded.shape, f"expert {expert_id} {proj}_proj")
            local = self._local_expert(expert_id)
            if local is None:
                return set()
            rows = materialize(loaded.narrow(0, start, size))
            param.data[local].narrow(0, 0 if proj == GATE else size, size).copy_(rows)
            return {(proj, expert_id)}
        raise ValueError(f"unknown expert shard {shard_id!r} for w13")

    def _load_w2(self, param: nn.Parameter, loaded: Loaded, shard_id: Hashable) -> set[Hashable]:
        proj, expert_id = shard_id  # type: ignore[misc]
        check_dtype(param, loaded)
        full, start, size, hidden = self._sizes(param, w13=False)
        if proj != DOWN:
            raise ValueError(f"unknown expert shard {shard_id!r} for w2")
        if expert_id is None:
            stacked = self._local_experts(loaded, "stacked down_proj", (hidden, full))
            param.data.copy_(materialize(stacked.narrow(2, start, size)))
            return set(param.shard_ids)  # type: ignore[attr-defined]
        check_shape(torch.Size((hidden, full)), loaded.shape, f"expert {expert_id} down_proj")
        local = self._local_expert(expert_id)
        if local is None:
            return set()
        param.data[local].copy_(materialize(loaded.narrow(1, start, size)))
        return {(DOWN, expert_id)}

    def takes_fp8_rows(self, hidden: torch.Tensor) -> bool:
        """Whether forward on hidden reads its rows quantized per token-group (W8A8 experts)."""
        takes = getattr(self.quant_method, "takes_fp8_rows", None)
        return takes is not None and takes(self, hidden)

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        x_fp8: Fp8GroupRows | None = None,
    ) -> torch.Tensor:
        """hidden: [T, H], router_logits: [T, E] -> [T, H] (summed over the ranks); `x_fp8`:
        hidden's FP8 rows, where `takes_fp8_rows(hidden)`."""
        topk_weights, topk_ids = self._router(router_logits, self.top_k, self.renormalize)
        if self.expert_parallel:
            local_ids = topk_ids - self.expert_start
            topk_ids = local_ids.masked_fill(
                (local_ids < 0) | (local_ids >= self.num_local_experts), -1
            )
        if self.quant_method is not None:
            rows = () if x_fp8 is None else (x_fp8,)
            out = self.quant_method.apply(self, hidden, topk_weights, topk_ids, *rows)
        else:
            out = self._kernel(hidden, self.w13, self.w2, topk_weights, topk_ids)
        return self.tp_group.all_reduce(out)
