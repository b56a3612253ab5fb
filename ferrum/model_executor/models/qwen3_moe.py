"""Qwen3-MoE: Qwen3 attention; sparse MoE blocks on the layers `decoder_sparse_step` selects
(except `mlp_only_layers`), a dense MLP of `intermediate_size` elsewhere."""

from __future__ import annotations

import re
from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.kernels.interface import Kernels
from ferrum.model_arch import ModelArchConfig
from ferrum.model_executor.layers.fused_moe import DOWN, GATE_UP, FusedMoE
from ferrum.model_executor.layers.linear import Linear
from ferrum.model_executor.layers.quantization import get_linear_method, get_moe_method
from ferrum.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP, layer_prefix
from ferrum.model_executor.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM
from ferrum.model_executor.pipeline_stage import PipelineStage
from ferrum.quant_config import QuantConfig

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows

# Per-expert tensors (`...mlp.experts.{e}.gate_proj.weight`, and `.weight_scale_inv` in FP8
# checkpoints) and the stacked HF layout (`...mlp.experts.gate_up_proj` [E, 2I, H],
# `...mlp.experts.down_proj` [E, H, I]).
_PER_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv|qweight|scales|"
    r"qzeros|weight_packed|weight_scale)$"
)
# Int4 experts' tensors that carry nothing to load: g_idx (act-order experts are refused, so it
# is the identity grouping) and compressed-tensors' weight_shape.
_SKIPPED_EXPERT = re.compile(r"^.*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.(g_idx|weight_shape)$")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj(\.weight)?$")


def router_gate(arch: ModelArchConfig, kernels: Kernels, prefix: str) -> Linear:
    """The MoE router's linear layer: in the model dtype (as in Qwen's FP8 checkpoints), on the
    dense method, so that a one-row step takes the GEMV where it has tiles."""
    return Linear(
        arch.hidden_size,
        arch.num_experts,
        bias=False,
        quant_method=get_linear_method(None, kernels, [f"{prefix}.gate"]),
    )


class Qwen3MoeSparseMoeBlock(nn.Module):
    """The router is replicated on every rank; the experts are split (see FusedMoE)."""

    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        tp_group: TensorParallelGroup | None = None,
        expert_parallel: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "mlp",
    ) -> None:
        super().__init__()
        self.gate = router_gate(arch, kernels, prefix)
        self.experts = FusedMoE(
            num_experts=arch.num_experts,
            top_k=arch.num_experts_per_tok,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.moe_intermediate_size,
            renormalize=arch.norm_topk_prob,
            hidden_act=arch.hidden_act,
            kernels=kernels,
            tp_group=tp_group,
            expert_parallel=expert_parallel,
            quant_method=get_moe_method(quant_config, kernels, prefix, arch.num_experts),
        )

    def takes_fp8_rows(self, hidden: torch.Tensor) -> bool:
        """Whether the experts read hidden's FP8 rows (W8A8): the norm before writes them."""
        return self.experts.takes_fp8_rows(hidden)

    def forward(self, hidden: torch.Tensor, x_fp8: Fp8GroupRows | None = None) -> torch.Tensor:
        """The router reads hidden; the experts hidden's FP8 rows too where they take them."""
        return self.experts(hidden, self.gate(hidden), x_fp8)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        *,
        tp_group: TensorParallelGroup | None = None,
        enable_expert_parallel: bool = False,
        quant_config: QuantConfig | None = None,
        pipeline_stage: PipelineStage | None = None,
    ) -> None:
        if arch.num_experts < 1:
            raise ValueError(f"num_experts: missing from config.json ({arch.architecture})")
        super().__init__(
            arch,
            kernels,
            tp_group=tp_group,
            enable_expert_parallel=enable_expert_parallel,
            quant_config=quant_config,
            pipeline_stage=pipeline_stage,
        )

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, kernels = self.arch, self.kernels
        quant, prefix = self.quant_config, layer_prefix(layer_idx)
        sparse = (layer_idx + 1) % arch.decoder_sparse_step == 0
        group = self.tp_group
        if sparse and layer_idx not in arch.mlp_only_layers:
            mlp: nn.Module = Qwen3MoeSparseMoeBlock(
                arch, kernels, group, self.enable_expert_parallel, quant, f"{prefix}.mlp"
            )
        else:
            mlp = LlamaMLP(arch, kernels, False, group, quant, f"{prefix}.mlp")
        attention = Qwen3Attention(arch, kernels, group, quant, f"{prefix}.self_attn")
        return LlamaDecoderLayer(attention, mlp, arch, kernels)

    def map_checkpoint_name(self, name: str) -> tuple[str, Hashable] | None:
        if _SKIPPED_EXPERT.match(name):
            return None
        return map_expert_name(name) or super().map_checkpoint_name(name)


def map_expert_name(name: str) -> tuple[str, Hashable] | None:
    """An expert tensor's (FusedMoE parameter, shard id); None for other names."""
    match = _PER_EXPERT.match(name)
    if match:
        prefix, expert_id, proj = match.group(1), int(match.group(2)), match.group(3)
        param = f"{prefix}.w2" if proj == "down" else f"{prefix}.w13"
        if match.group(4) == "weight_scale_inv":
            param += "_scale"
        elif match.group(4) != "weight":  # int4 experts (Int4MoEMethod)
            param += "_" + match.group(4)
        return param, (proj, expert_id)
    match = _STACKED.match(name)
    if match:
        prefix, proj = match.group(1), match.group(2)
        if proj == "down":
            return f"{prefix}.w2", (DOWN, None)
        return f"{prefix}.w13", (GATE_UP, None)
    return None
