"""Qwen2 / Qwen2.5: the Llama architecture with biases on the q, k and v projections."""

from __future__ import annotations

from torch import nn

from ferrum.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, kernels = self.arch, self.kernels
        return LlamaDecoderLayer(
            LlamaAttention(arch, kernels, qkv_bias=True, o_bias=False, tp_group=self.tp_group),
            LlamaMLP(arch, kernels, bias=False, tp_group=self.tp_group),
            arch,
            kernels,
        )
