"""Qwen3 (dense): Llama-style blocks with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from torch import nn

from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.kernels.interface import Kernels
from ferrum.model_arch import ModelArchConfig
from ferrum.model_executor.layers.layernorm import RMSNorm
from ferrum.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    layer_prefix,
)
from ferrum.quant_config import QuantConfig


class Qwen3Attention(LlamaAttention):
    """The q/k norms act per head (weights [head_dim]), so every rank holds them whole."""

    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: Kernels,
        tp_group: TensorParallelGroup | None = None,
        quant_config: QuantConfig | None = None,
        prefix: str = "self_attn",
    ) -> None:
        bias = arch.attention_bias
        super().__init__(
            arch,
            kernels,
            qkv_bias=bias,
            o_bias=bias,
            tp_group=tp_group,
            quant_config=quant_config,
            prefix=prefix,
        )
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, kernels)
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, kernels)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, kernels, tp = self.arch, self.kernels, self.tp_group
        quant, prefix = self.quant_config, layer_prefix(layer_idx)
        return LlamaDecoderLayer(
            Qwen3Attention(arch, kernels, tp, quant, f"{prefix}.self_attn"),
            LlamaMLP(arch, kernels, False, tp, quant, f"{prefix}.mlp"),
            arch,
            kernels,
        )
