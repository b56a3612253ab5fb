"""Qwen2 / Qwen2.5: the Llama architecture with biases on the q, k and v projections."""

from __future__ import annotations

from torch import nn

from ferrum.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    required,
)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        hf = self.model_config.hf_config
        hidden_size = int(required(hf, "hidden_size"))
        return LlamaDecoderLayer(
            LlamaAttention(self.model_config, qkv_bias=True, o_bias=False),
            LlamaMLP(
                hidden_size, int(required(hf, "intermediate_size")), hf.get("hidden_act", "silu")
            ),
            hidden_size,
            float(hf.get("rms_norm_eps", 1e-6)),
        )
