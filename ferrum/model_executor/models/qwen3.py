"""Qwen3 (dense): Llama-style blocks with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from torch import nn

from ferrum.config import ModelConfig
from ferrum.model_executor.layers.layernorm import RMSNorm
from ferrum.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    required,
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, model_config: ModelConfig) -> None:
        hf = model_config.hf_config
        bias = bool(hf.get("attention_bias", False))
        super().__init__(model_config, qkv_bias=bias, o_bias=bias)
        eps = float(hf.get("rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.head_dim, eps)
        self.k_norm = RMSNorm(self.head_dim, eps)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        hf = self.model_config.hf_config
        hidden_size = int(required(hf, "hidden_size"))
        return LlamaDecoderLayer(
            Qwen3Attention(self.model_config),
            LlamaMLP(
                hidden_size, int(required(hf, "intermediate_size")), hf.get("hidden_act", "silu")
            ),
            hidden_size,
            float(hf.get("rms_norm_eps", 1e-6)),
        )
