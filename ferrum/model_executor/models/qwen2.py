"""Qwen2 / Qwen2.5: the Llama architecture with biases on the q, k and v projections."""

from __future__ import annotations

from torch import nn

from ferrum.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    layer_prefix,
)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, kernels, tp = self.arch, self.kernels, self.tp_group
        quant, prefix = self.quant_config, layer_prefix(layer_idx)
        return LlamaDecoderLayer(
            LlamaAttention(
                arch,
                kernels,
                qkv_bias=True,
                o_bias=False,
                tp_group=tp,
                quant_config=quant,
                prefix=f"{prefix}.self_attn",
            ),
            LlamaMLP(arch, kernels, False, tp, quant, f"{prefix}.mlp"),
            arch,
            kernels,
        )
