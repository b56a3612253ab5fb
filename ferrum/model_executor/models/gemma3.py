"""Gemma 3 (text): interleaved sliding-window (local) and global attention layers, each kind with
its own RoPE base, per-head q/k norms, norms before and after attention and MLP, embeddings
scaled by sqrt(hidden_size), Gemma's (1 + w) RMSNorm and a tanh-approximated GELU MLP.
`Gemma3ForConditionalGeneration` checkpoints load their language model only (text input)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.kernels.interface import Kernels
from ferrum.model_arch import SLIDING_ATTENTION, ModelArchConfig
from ferrum.model_executor.layers.embed_head import VocabEmbedding
from ferrum.model_executor.layers.layernorm import GemmaRMSNorm
from ferrum.model_executor.layers.rotary import RotaryEmbedding
from ferrum.model_executor.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    layer_prefix,
)
from ferrum.model_executor.pipeline_stage import (
    PipelineStage,
    StageActivations,
    stage_input,
    stage_layers,
    stage_output,
    whole_model,
)
from ferrum.quant_config import QuantConfig

if TYPE_CHECKING:
    from ferrum.model_executor.attention_metadata import AttentionMetadata

# Checkpoint prefixes of the language model inside the multimodal container (transformers 5
# and the older layout) -> ferrum's names.
_LANGUAGE_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


class ScaledVocabEmbedding(VocabEmbedding):
    """Embeddings times sqrt(hidden_size), the factor rounded to the weights' dtype as in HF."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # A host float (no tensor copy, so CUDA graphs can capture it) equal to the rounded factor.
        scale = torch.tensor(self.weight.shape[1] ** 0.5, dtype=self.weight.dtype).item()
        return super().forward(input_ids) * scale


class Gemma3Attention(LlamaAttention):
    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        layer_idx: int,
        tp_group: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None,
    ) -> None:
        scalar = arch.query_pre_attn_scalar
        super().__init__(
            arch,
            kernels,
            qkv_bias=arch.attention_bias,
            o_bias=arch.attention_bias,
            sliding_window=arch.layer_sliding_window(layer_idx),
            scale=None if scalar is None else scalar**-0.5,
            tp_group=tp_group,
            quant_config=quant_config,
            prefix=f"{layer_prefix(layer_idx)}.self_attn",
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps, kernels)
        self.k_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps, kernels)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        layer_idx: int,
        tp_group: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None,
    ) -> None:
        super().__init__()
        self.is_sliding = arch.layer_types[layer_idx] == SLIDING_ATTENTION
        self.self_attn = Gemma3Attention(arch, kernels, layer_idx, tp_group, quant_config)
        mlp_prefix = f"{layer_prefix(layer_idx)}.mlp"
        self.mlp = LlamaMLP(arch, kernels, False, tp_group, quant_config, mlp_prefix)
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, kernels)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, kernels)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, kernels)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, kernels)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream is hidden + residual (hidden alone for the first layer); returns the
        post-feedforward-normed MLP output and the stream before it."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, cos, sin, attn_metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3Model(nn.Module):
    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        tp_group: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        stage = stage or whole_model(arch.num_hidden_layers)
        self.embed_tokens = (
            ScaledVocabEmbedding(arch.vocab_size, arch.hidden_size, tp_group)
            if stage.is_first
            else None
        )
        max_position = arch.max_position_embeddings
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, max_position, arch.rope_theta, arch.rope_scaling
        )
        self.rotary_emb_local = RotaryEmbedding(
            arch.head_dim, max_position, arch.local_rope_theta, arch.local_rope_scaling
        )
        self.layers = stage_layers(
            stage,
            arch.num_hidden_layers,
            lambda i: Gemma3DecoderLayer(arch, kernels, i, tp_group, quant_config),
        )
        self.stage_layers = [self.layers[i] for i in stage.layer_ids]
        self.norm = (
            GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, kernels) if stage.is_last else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        intermediate: StageActivations | None = None,
    ) -> torch.Tensor | StageActivations:
        hidden, residual = stage_input(self.embed_tokens, input_ids, intermediate)
        global_rope = self.rotary_emb(positions)
        local_rope = self.rotary_emb_local(positions)
        for layer in self.stage_layers:
            cos, sin = local_rope if layer.is_sliding else global_rope
            hidden, residual = layer(hidden, residual, cos, sin, attn_metadata)
        return stage_output(self.norm, hidden, residual)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def make_model(self) -> nn.Module:
        return Gemma3Model(self.arch, self.kernels, self.tp_group, self.quant_config, self.stage)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size] float32, soft-capped when the config says so."""
        logits = self.lm_head(hidden_states)
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def map_checkpoint_name(self, name: str) -> tuple[str, Hashable] | None:
        if name.startswith(_VISION_PREFIXES):
            return None
        for ckpt_prefix, prefix in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(ckpt_prefix):
                name = prefix + name.removeprefix(ckpt_prefix)
                break
        return super().map_checkpoint_name(name)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 vision-language checkpoint (text input only)."""
