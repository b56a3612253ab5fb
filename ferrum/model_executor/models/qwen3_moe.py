"""Qwen3-MoE: Qwen3 attention; sparse MoE blocks on the layers `decoder_sparse_step` selects
(except `mlp_only_layers`), a dense MLP of `intermediate_size` elsewhere."""

from __future__ import annotations

import re
from collections.abc import Hashable

import torch
from torch import nn

from ferrum.model_executor.layers.fused_moe import DOWN, GATE_UP, FusedMoE
from ferrum.model_executor.layers.linear import Linear
from ferrum.model_executor.models.llama import LlamaDecoderLayer, LlamaMLP, required
from ferrum.model_executor.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM

# Per-expert tensors (`...mlp.experts.{e}.gate_proj.weight`) and the stacked HF layout
# (`...mlp.experts.gate_up_proj` [E, 2I, H], `...mlp.experts.down_proj` [E, H, I]).
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj(\.weight)?$")


def num_experts(hf_config: dict) -> int:
    """Qwen checkpoints write `num_experts`; transformers 5 may write `num_local_experts`."""
    value = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    if value is None:
        raise ValueError("num_experts: missing from config.json")
    return int(value)


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, hf_config: dict) -> None:
        super().__init__()
        hidden_size = int(required(hf_config, "hidden_size"))
        experts = num_experts(hf_config)
        self.gate = Linear(hidden_size, experts, bias=False)
        self.experts = FusedMoE(
            num_experts=experts,
            top_k=int(required(hf_config, "num_experts_per_tok")),
            hidden_size=hidden_size,
            intermediate_size=int(required(hf_config, "moe_intermediate_size")),
            renormalize=bool(hf_config.get("norm_topk_prob", False)),
            hidden_act=hf_config.get("hidden_act", "silu"),
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


def is_moe_layer(hf_config: dict, layer_idx: int) -> bool:
    step = int(hf_config.get("decoder_sparse_step", 1))
    if step < 1:
        raise ValueError(f"decoder_sparse_step: must be >= 1, got {step}")
    return (
        num_experts(hf_config) > 0
        and (layer_idx + 1) % step == 0
        and layer_idx not in (hf_config.get("mlp_only_layers") or [])
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        hf = self.model_config.hf_config
        hidden_size = int(required(hf, "hidden_size"))
        if is_moe_layer(hf, layer_idx):
            mlp: nn.Module = Qwen3MoeSparseMoeBlock(hf)
        else:
            mlp = LlamaMLP(
                hidden_size, int(required(hf, "intermediate_size")), hf.get("hidden_act", "silu")
            )
        return LlamaDecoderLayer(
            Qwen3Attention(self.model_config),
            mlp,
            hidden_size,
            float(hf.get("rms_norm_eps", 1e-6)),
        )

    def map_checkpoint_name(self, name: str) -> tuple[str, Hashable] | None:
        match = _PER_EXPERT.match(name)
        if match:
            prefix, expert_id, proj = match.group(1), int(match.group(2)), match.group(3)
            param = f"{prefix}.w2" if proj == "down" else f"{prefix}.w13"
            return param, (proj, expert_id)
        match = _STACKED.match(name)
        if match:
            prefix, proj = match.group(1), match.group(2)
            if proj == "down":
                return f"{prefix}.w2", (DOWN, None)
            return f"{prefix}.w13", (GATE_UP, None)
        return super().map_checkpoint_name(name)
