"""Mistral: the Llama architecture, optionally with sliding-window attention in every layer."""

from __future__ import annotations

from torch import nn

from ferrum.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    layer_prefix,
)


class MistralForCausalLM(LlamaForCausalLM):
    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, kernels = self.arch, self.kernels
        quant, prefix = self.quant_config, layer_prefix(layer_idx)
        window = arch.layer_sliding_window(layer_idx)
        return LlamaDecoderLayer(
            LlamaAttention(
                arch,
                kernels,
                qkv_bias=False,
                o_bias=False,
                sliding_window=window,
                tp_group=self.tp_group,
                quant_config=quant,
                prefix=f"{prefix}.self_attn",
            ),
            LlamaMLP(arch, kernels, False, self.tp_group, quant, f"{prefix}.mlp"),
            arch,
            kernels,
        )
