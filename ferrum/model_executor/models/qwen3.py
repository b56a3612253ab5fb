"""Qwen3 (dense): Llama-style blocks with a per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

from torch import nn

from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.model_arch import ModelArchConfig
from ferrum.model_executor.kernel_backend import TritonKernels
from ferrum.model_executor.layers.layernorm import RMSNorm
from ferrum.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)


class Qwen3Attention(LlamaAttention):
    """The q/k norms act per head (weights [head_dim]), so every rank holds them whole."""

    def __init__(
        self,
        arch: ModelArchConfig,
        kernels: TritonKernels | None,
        tp_group: TensorParallelGroup | None = None,
    ) -> None:
        bias = arch.attention_bias
        super().__init__(arch, kernels, qkv_bias=bias, o_bias=bias, tp_group=tp_group)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, kernels)
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, kernels)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, kernels = self.arch, self.kernels
        return LlamaDecoderLayer(
            Qwen3Attention(arch, kernels, self.tp_group),
            LlamaMLP(arch, kernels, bias=False, tp_group=self.tp_group),
            arch,
            kernels,
        )
