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
    from ferrum.model_executor.attention_metadata import AttentionMetadata, VerifyStates


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
        """[num_tokens, hidden] -> [num_tokens, hidden]; advances each request's state (a step
        that verifies drafts keeps the states after each of them: `verify_states.py`)."""
        if self.conv_state is None or self.recurrent_state is None:
            raise ValueError("kv_caches: no state bound; call model.bind_kv_caches first")
        num_tokens = hidden.shape[0]
        qkv, z, b, a = self.in_proj(hidden).split(
            [self.conv_dim, self.value_size, self.num_v_heads, self.num_v_heads], dim=-1
        )
        beta = b.sigmoid().contiguous()
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).contiguous()
        qkv = qkv.contiguous()
        verify = attn_metadata.verify_states
        if verify is not None:
            out = mix_verify_step(self, qkv, g, beta, attn_metadata, verify)
        elif attn_metadata.num_tokens == attn_metadata.num_reqs:
            out = self.mix_decode(qkv, g, beta, self._live_slots(attn_metadata))
        else:
            out = self.mix_chunks(qkv, g, beta, self._live_slots(attn_metadata), attn_metadata)
        out = self.norm(out, z.reshape(num_tokens, self.num_v_heads, self.v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_size))

    def _live_slots(self, attn_metadata: AttentionMetadata) -> torch.Tensor:
        return attn_metadata.block_tables[self.kv_cache_group][:, 0].contiguous()

    def _split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = qkv.shape[0]
        q, k, v = qkv.split([self.key_size, self.key_size, self.value_size], dim=-1)
        return (
            q.view(n, self.num_k_heads, self.k_dim),
            k.view(n, self.num_k_heads, self.k_dim),
            v.view(n, self.num_v_heads, self.v_dim),
        )

    def mix_decode(
        self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slot_ids: torch.Tensor
    ) -> torch.Tensor:
        """Token i is request i's next: conv and gated delta rule from (and into) slot_ids[i]
        (< 0: padding, zero output); [num_tokens, num_v_heads, v_dim]."""
        assert self.conv_state is not None and self.recurrent_state is not None
        kernels = self.kernels
        qkv = kernels.causal_conv1d_update(qkv, self.conv_weight, None, self.conv_state, slot_ids)
        q, k, v = self._split_heads(qkv)
        return kernels.gated_delta_rule_decode(
            q, k, v, g, beta, self.recurrent_state, slot_ids, use_qk_l2norm=True
        )

    def mix_chunks(
        self,
        qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        slot_ids: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Request i's chunk (query_start_loc) from and into slot_ids[i] (< 0: skipped)."""
        assert self.conv_state is not None and self.recurrent_state is not None
        kernels, starts = self.kernels, attn_metadata.query_start_loc
        qkv = kernels.causal_conv1d_prefill(
            qkv,
            self.conv_weight,
            None,
            self.conv_state,
            starts,
            slot_ids,
            attn_metadata.max_query_len,
        )
        q, k, v = self._split_heads(qkv)
        return kernels.gated_delta_rule_prefill(
            q, k, v, g, beta, starts, self.recurrent_state, slot_ids, use_qk_l2norm=True
        )

    def copy_conv_states(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copies the conv states of slots src_slots[i] into dst_slots[i]."""
        pool = self.conv_state
        assert pool is not None
        pool.index_copy_(0, dst_slots, pool.index_select(0, src_slots))


def mix_verify_step(
    layer: GatedDeltaNet,
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    attn_metadata: AttentionMetadata,
    verify: VerifyStates,
) -> torch.Tensor:
    """The token mixing of a verifying step (see `VerifyStates`): chunk rows as usual, then the
    other rows one position at a time (static shapes: a CUDA graph replays it), the recurrent
    state along each row's chain of slots, the conv state in the live slot and copied along."""
    num_tokens = qkv.shape[0]
    shape = (num_tokens + 1, layer.num_v_heads, layer.v_dim)  # row num_tokens: a sink
    out = torch.zeros(shape, dtype=qkv.dtype, device=qkv.device)
    if verify.prefill_slots is not None:
        out[:num_tokens] = layer.mix_chunks(qkv, g, beta, verify.prefill_slots, attn_metadata)
    starts = attn_metadata.query_start_loc.long()
    first, ends = starts[:-1], starts[1:]
    live, chain = verify.step_slots, verify.state_slots
    live_index = live.long().clamp(min=0)
    no_slot = torch.full_like(live, -1)
    for j in range(verify.query_len):
        token = first + j
        valid = (token < ends) & (live >= 0)
        gather = torch.where(valid, token, 0)
        conv_slots = torch.where(valid, live, no_slot)
        qkv_j = layer.kernels.causal_conv1d_update(
            qkv[gather], layer.conv_weight, None, layer.conv_state, conv_slots
        )
        q, k, v = layer._split_heads(qkv_j)
        mixed = layer.kernels.gated_delta_rule_decode(
            q,
            k,
            v,
            g[gather],
            beta[gather],
            layer.recurrent_state,
            torch.where(valid, chain[:, j], no_slot),
            use_qk_l2norm=True,
            dst_slot_ids=chain[:, j + 1].contiguous(),
        )
        out.index_copy_(0, torch.where(valid, token, num_tokens), mixed)
        if j + 1 < verify.query_len:  # the conv state after token j beside the recurrent one
            layer.copy_conv_states(live_index, chain[:, j + 1].long())
    return out[:num_tokens]
