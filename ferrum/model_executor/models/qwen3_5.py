"""Qwen3.5 (text): gated DeltaNet linear-attention layers (layers/gated_delta_net.py) interleaved
with gated full attention every `full_attention_interval` layers: q_proj yields each head's query
and a gate, q/k get a per-head RMSNorm, RoPE rotates the first head_dim * partial_rotary_factor
dims, and the output is multiplied by sigmoid(gate). Norms are (1 + w) RMSNorms. Text only: the
multimodal RoPE reduces to plain RoPE when every axis has the text position; no vision tower."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.kernels.interface import Kernels
from ferrum.kernels.rotary_kv_ref import rope_ref
from ferrum.model_arch import LINEAR_ATTENTION, ModelArchConfig
from ferrum.model_executor.layers.attention import Attention
from ferrum.model_executor.layers.embed_head import VocabEmbedding
from ferrum.model_executor.layers.fused_moe import FusedMoE
from ferrum.model_executor.layers.gated_delta_net import GatedDeltaNet
from ferrum.model_executor.layers.layernorm import GemmaRMSNorm
from ferrum.model_executor.layers.linear import Linear, MergedLinear
from ferrum.model_executor.layers.rotary import RotaryEmbedding
from ferrum.model_executor.models.llama import LlamaForCausalLM, LlamaMLP, layer_prefix
from ferrum.model_executor.models.qwen3_moe import map_expert_name, router_gate
from ferrum.model_executor.pipeline_stage import (
    PipelineStage,
    StageActivations,
    stage_input,
    stage_output,
)
from ferrum.quant_config import QuantConfig

if TYPE_CHECKING:
    from ferrum.kernels.paged_attention import SplitKVWorkspace
    from ferrum.model_executor.attention_metadata import AttentionMetadata

# Checkpoint prefixes of the multimodal container -> ferrum's names; tensors under the skipped
# prefixes (vision tower, multi-token-prediction head) are not loaded.
_LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."),)
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.")
# linear_attn's four input projections are one merged matrix.
_IN_PROJ_SHARDS = ("qkv", "z", "b", "a")


class Qwen3_5Attention(nn.Module):
    """Gated full attention with partial rotary (see the module docstring)."""

    def __init__(self, arch: ModelArchConfig, kernels: Kernels) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = head_dim = arch.head_dim
        self.rotary_dim = int(head_dim * arch.partial_rotary_factor)
        bias = arch.attention_bias
        self.qkv_proj = MergedLinear(
            arch.hidden_size,
            {
                "q": 2 * self.num_heads * head_dim,
                "k": self.num_kv_heads * head_dim,
                "v": self.num_kv_heads * head_dim,
            },
            bias,
        )
        self.o_proj = Linear(self.num_heads * head_dim, arch.hidden_size, bias)
        self.q_norm = GemmaRMSNorm(head_dim, arch.rms_norm_eps, kernels)
        self.k_norm = GemmaRMSNorm(head_dim, arch.rms_norm_eps, kernels)
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim**-0.5, kernels)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == self.head_dim:
            return rope_ref(x, cos, sin)
        return torch.cat([rope_ref(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,  # [num_tokens, rotary_dim // 2]
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens, d = hidden.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj(hidden).split(
            [2 * self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1
        )
        q_gate = q_gate.view(num_tokens, self.num_heads, 2 * d)
        gate = q_gate[..., d:].reshape(num_tokens, self.num_heads * d)
        q = self.q_norm(q_gate[..., :d].reshape(-1, d)).view(num_tokens, self.num_heads, d)
        k = self.k_norm(k.reshape(-1, d)).view(num_tokens, self.num_kv_heads, d)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, d)
        # RoPE is applied above (partially); the layer's own rotation is the identity.
        unit_cos = torch.ones((num_tokens, d // 2), dtype=torch.float32, device=hidden.device)
        zero_sin = torch.zeros((num_tokens, d // 2), dtype=torch.float32, device=hidden.device)
        out = self.attn(q, k, v, unit_cos, zero_sin, attn_metadata)
        out = out.reshape(num_tokens, self.num_heads * d) * torch.sigmoid(gate)
        return self.o_proj(out)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        layer_idx: int,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.is_linear = arch.layer_types[layer_idx] == LINEAR_ATTENTION
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(arch, kernels)
        else:
            self.self_attn = Qwen3_5Attention(arch, kernels)
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)
        self.post_attention_layernorm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it); the next norm adds the two."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, attn_metadata)
        else:
            hidden = self.self_attn(hidden, cos, sin, attn_metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3_5Model(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        make_layer: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(arch.vocab_size, arch.hidden_size)
        self.rotary_emb = RotaryEmbedding(
            int(arch.head_dim * arch.partial_rotary_factor),
            arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
        )
        self.layers = nn.ModuleList(make_layer(i) for i in range(arch.num_hidden_layers))
        self.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate: StageActivations | None = None,
    ) -> torch.Tensor | StageActivations:
        """One pipeline stage only (the model refuses more): `intermediate` is always None."""
        hidden, residual = stage_input(self.embed_tokens, input_ids, intermediate)
        cos, sin = self.rotary_emb(positions)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, attn_metadata)
        return stage_output(self.norm, hidden, residual)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
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
        if pipeline_stage is not None and pipeline_stage.size > 1:
            raise ValueError(
                f"pipeline_parallel_size: {arch.architecture} runs on one GPU only for now, got "
                f"{pipeline_stage.size}"
            )
        if tp_group is not None and tp_group.world_size > 1:
            raise ValueError(
                f"tensor_parallel_size: {arch.architecture} runs on one GPU only for now, got "
                f"{tp_group.world_size}"
            )
        if quant_config is not None:
            raise ValueError(f"quantization: {arch.architecture} is not supported quantized yet")
        super().__init__(
            arch,
            kernels,
            tp_group=tp_group,
            enable_expert_parallel=enable_expert_parallel,
            quant_config=quant_config,
        )

    def make_model(self) -> nn.Module:
        return Qwen3_5Model(self.arch, self.kernels, self.make_decoder_layer)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return LlamaMLP(self.arch, self.kernels, False, prefix=f"{layer_prefix(layer_idx)}.mlp")

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        return Qwen3_5DecoderLayer(self.arch, self.kernels, layer_idx, self.make_mlp(layer_idx))

    def bind_kv_caches(
        self,
        kv_caches: Sequence[torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
        split_kv_workspace: SplitKVWorkspace | None = None,
        kv_cache_groups: Sequence[int] | None = None,
    ) -> None:
        """Per decoder layer, in order: an attention layer's KV cache, or a linear-attention
        layer's (conv state, recurrent state) pools; an empty list unbinds them all."""
        layers = self.model.layers
        if kv_caches and len(kv_caches) != len(layers):
            raise ValueError(
                f"kv_caches: expected one cache per decoder layer ({len(layers)}), "
                f"got {len(kv_caches)}"
            )
        for i, layer in enumerate(layers):
            group = 0 if kv_cache_groups is None else kv_cache_groups[i]
            if not kv_caches:
                if layer.is_linear:
                    layer.linear_attn.unbind_state()
                else:
                    layer.self_attn.attn.unbind_kv_cache()
                continue
            cache = kv_caches[i]
            if layer.is_linear != isinstance(cache, tuple):
                raise ValueError(
                    f"kv_caches[{i}]: layer {i} needs "
                    + ("(conv, recurrent) state pools" if layer.is_linear else "a KV cache")
                )
            if layer.is_linear:
                layer.linear_attn.bind_state(cache[0], cache[1], group)
            else:
                layer.self_attn.attn.bind_kv_cache(cache, split_kv_workspace, group)

    def map_checkpoint_name(self, name: str) -> tuple[str, Hashable] | None:
        if name.startswith(_SKIPPED_PREFIXES):
            return None
        for ckpt_prefix, prefix in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(ckpt_prefix):
                name = prefix + name.removeprefix(ckpt_prefix)
                break
        if ".linear_attn." in name:
            for shard in _IN_PROJ_SHARDS:
                part = f".linear_attn.in_proj_{shard}."
                if part in name:
                    return name.replace(part, ".linear_attn.in_proj."), shard
            return name.replace(".linear_attn.conv1d.weight", ".linear_attn.conv_weight"), None
        return map_expert_name(name) or super().map_checkpoint_name(name)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The language model of a Qwen3.5 vision-language checkpoint (text input only)."""


class Qwen3_5MoeSparseMoeBlock(nn.Module):
    """Routed experts (softmax top-k, renormalized) plus a shared expert scaled by
    sigmoid(shared_expert_gate(x))."""

    def __init__(self, arch: ModelArchConfig, kernels: Kernels, prefix: str) -> None:
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
        )
        shared = replace(arch, intermediate_size=arch.shared_expert_intermediate_size)
        self.shared_expert = LlamaMLP(shared, kernels, False, prefix=f"{prefix}.shared_expert")
        self.shared_expert_gate = Linear(arch.hidden_size, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return self.experts(hidden, self.gate(hidden)) + shared


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def __init__(self, arch: ModelArchConfig, kernels: Kernels, **kwargs) -> None:
        if arch.num_experts < 1:
            raise ValueError(f"num_experts: missing from config.json ({arch.architecture})")
        if arch.shared_expert_intermediate_size < 1:
            raise ValueError(
                f"shared_expert_intermediate_size: missing from config.json ({arch.architecture})"
            )
        super().__init__(arch, kernels, **kwargs)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return Qwen3_5MoeSparseMoeBlock(self.arch, self.kernels, f"{layer_prefix(layer_idx)}.mlp")


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The language model of a Qwen3.5-MoE vision-language checkpoint (text input only)."""
