"""Gated DeltaNet linear attention (Qwen3.5's `linear_attn`) over per-request state slots. A fused
projection gives qkv (through a short causal conv + SiLU), the gate z, beta = sigmoid(b) and
g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule updates each value head's state; a
per-head RMSNorm gated by SiLU(z) and `out_proj` follow. The runner binds the conv and recurrent
(fp32) pools; a request's slot heads its block table and is zeroed before its first token, so
every sequence continues from its slot's state."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ferrum.kernels.interface import Kernels
from ferrum.model_arch import ModelArchConfig
from ferrum.model_executor.layers.linear import (
    Linear,
    MergedLinear,
    check_shape,
    new_parameter,
    set_weight_loader,
)

if TYPE_CHECKING:
    from ferrum.model_executor.attention_metadata import AttentionMetadata


def _load_conv_weight(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> set:
    """HF's Conv1d weight [conv_dim, 1, width] -> [conv_dim, width]."""
    if shard_id is not None:
        raise ValueError(f"parameter takes no shard, got shard {shard_id!r}")
    loaded = loaded.reshape(loaded.shape[0], -1) if loaded.dim() == 3 else loaded
    check_shape(param.shape, loaded.shape, "conv1d.weight")
    param.data.copy_(loaded)
    return {None}


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim (plain weight), then times SiLU(gate), as HF's
    Qwen3_5RMSNormGated: the normed x is rounded to x's dtype before the weight."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = new_parameter(hidden_size)
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, arch: ModelArchConfig, kernels: Kernels) -> None:
        super().__init__()
        self.num_k_heads = arch.linear_num_key_heads
        self.num_v_heads = arch.linear_num_value_heads
        self.k_dim = arch.linear_key_head_dim
        self.v_dim = arch.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads: must be a multiple of linear_num_key_heads="
                f"{self.num_k_heads}, got {self.num_v_heads}"
            )
        self.key_size = self.num_k_heads * self.k_dim
        self.value_size = self.num_v_heads * self.v_dim
        self.conv_dim = 2 * self.key_size + self.value_size
        self.conv_width = arch.linear_conv_kernel_dim
        if self.conv_width < 2:
            raise ValueError(f"linear_conv_kernel_dim: must be >= 2, got {self.conv_width}")
        if arch.hidden_act != "silu":
            raise ValueError(f"hidden_act: gated DeltaNet supports 'silu', got {arch.hidden_act!r}")
        self.in_proj = MergedLinear(
            arch.hidden_size,
            {
                "qkv": self.conv_dim,
                "z": self.value_size,
                "b": self.num_v_heads,
                "a": self.num_v_heads,
            },
        )
        self.conv_weight = new_parameter(self.conv_dim, self.conv_width)
        set_weight_loader(self.conv_weight, _load_conv_weight)
        self.dt_bias = new_parameter(self.num_v_heads)
        self.A_log = new_parameter(self.num_v_heads)
        self.norm = GatedRMSNorm(self.v_dim, arch.rms_norm_eps)
        self.out_proj = Linear(self.value_size, arch.hidden_size)
        self.kernels = kernels
        self.conv_state: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None
        self.kv_cache_group = 0

    def bind_state(
        self, conv_state: torch.Tensor, recurrent_state: torch.Tensor, kv_cache_group: int
    ) -> None:
        conv_shape = (self.conv_width - 1, self.conv_dim)
        state_shape = (self.num_v_heads, self.k_dim, self.v_dim)
        if tuple(conv_state.shape[1:]) != conv_shape or tuple(recurrent_state.shape[1:]) != (
            state_shape
        ):
            raise ValueError(
                f"kv_caches: a linear-attention layer's state pools must be [num_slots, "
                f"{conv_shape[0]}, {conv_shape[1]}] and [num_slots, {state_shape[0]}, "
                f"{state_shape[1]}, {state_shape[2]}], got {list(conv_state.shape)} and "
                f"{list(recurrent_state.shape)}"
            )
        self.conv_state = conv_state
        self.recurrent_state = recurrent_state
        self.kv_cache_group = kv_cache_group

    def unbind_state(self) -> None:
        self.conv_state = self.recurrent_state = None

    def forward(self, hidden: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """[num_tokens, hidden] -> [num_tokens, hidden]; advances each request's state."""
        conv_pool, state_pool, kernels = self.conv_state, self.recurrent_state, self.kernels
        if conv_pool is None or state_pool is None:
            raise ValueError("kv_caches: no state bound; call model.bind_kv_caches first")
        num_tokens = hidden.shape[0]
        qkv, z, b, a = self.in_proj(hidden).split(
            [self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads], dim=-1
        )
        slot_ids = attn_metadata.block_tables[self.kv_cache_group][:, 0].contiguous()
        starts, weight = attn_metadata.query_start_loc, self.conv_weight
        decode = attn_metadata.num_tokens == attn_metadata.num_reqs
        if decode:
            qkv = kernels.causal_conv1d_update(qkv.contiguous(), weight, None, conv_pool, slot_ids)
        else:
            max_len = attn_metadata.max_query_len
            qkv = kernels.causal_conv1d_prefill(
                qkv.contiguous(), weight, None, conv_pool, starts, slot_ids, max_len
            )
        q, k, v = qkv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = q.view(num_tokens, self.num_k_heads, self.k_dim)
        k = k.view(num_tokens, self.num_k_heads, self.k_dim)
        v = v.view(num_tokens, self.num_v_heads, self.v_dim)
        beta = b.sigmoid().contiguous()
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).contiguous()
        if decode:
            out = kernels.gated_delta_rule_decode(
                q, k, v, g, beta, state_pool, slot_ids, use_qk_l2norm=True
            )
        else:
            out = kernels.gated_delta_rule_prefill(
                q, k, v, g, beta, starts, state_pool, slot_ids, use_qk_l2norm=True
            )
        out = self.norm(out, z.reshape(num_tokens, self.num_v_heads, self.v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_size))
