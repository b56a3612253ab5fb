"""Paged attention layer: writes this step's K/V into the layer's cache, then attends over it.

The cache per layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`, bound once by the
model runner through `bind_kv_cache`. The torch reference ops run by default;
`use_triton_kernels()` switches the layer to the Triton kernels (RoPE, the optional Qwen3 q/k norm
and the KV-cache write fused into one launch, then paged attention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ferrum.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref
from ferrum.model_executor.layers.rotary import apply_rotary_emb

if TYPE_CHECKING:
    from ferrum.model_executor.attention_metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    write_kv_cache_ref(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    return paged_attention_ref(
        query,
        kv_cache,
        attn_metadata.block_tables,
        attn_metadata.query_start_loc_cpu,
        attn_metadata.seq_lens_cpu,
        scale,
    )


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_key_value_heads: must divide num_attention_heads={num_heads}, "
                f"got {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None
        self._attention_kernels: Any = None
        self._rotary_kernels: Any = None

    def use_triton_kernels(self) -> None:
        from ferrum.kernels import paged_attention, rotary_kv

        self._attention_kernels = paged_attention
        self._rotary_kernels = rotary_kv

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        expected = (2, self.num_kv_heads, self.head_dim)
        found = (kv_cache.shape[0], *kv_cache.shape[3:]) if kv_cache.dim() == 5 else None
        if found != expected:
            raise ValueError(
                "kv_caches: each layer's cache must be [2, num_blocks, block_size, "
                f"{self.num_kv_heads}, {self.head_dim}], got {list(kv_cache.shape)}"
            )
        self.kv_cache = kv_cache

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns [num_tokens, num_heads, head_dim]."""
        kv_cache = self._bound_cache()
        if self._attention_kernels is None:
            write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
            return paged_attention(query, kv_cache, attn_metadata, self.scale)
        self._attention_kernels.write_kv_cache(key, value, kv_cache, attn_metadata.slot_mapping)
        return self._triton_attention(query, kv_cache, attn_metadata)

    def forward_with_rope(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos: torch.Tensor,  # [num_tokens, head_dim // 2] float32
        sin: torch.Tensor,  # [num_tokens, head_dim // 2] float32
        attn_metadata: AttentionMetadata,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> torch.Tensor:
        """Optional per-head q/k RMSNorm, RoPE, the KV write, then attention."""
        if self._rotary_kernels is None:
            if q_norm is not None and k_norm is not None:
                query, key = q_norm(query), k_norm(key)
            query = apply_rotary_emb(query, cos, sin)
            key = apply_rotary_emb(key, cos, sin)
            return self.forward(query, key, value, attn_metadata)
        kv_cache = self._bound_cache()
        self._rotary_kernels.rotary_kv(
            query,
            key,
            value,
            cos,
            sin,
            kv_cache,
            attn_metadata.slot_mapping,
            q_norm_weight=None if q_norm is None else q_norm.weight,
            k_norm_weight=None if k_norm is None else k_norm.weight,
            eps=1e-6 if q_norm is None else q_norm.eps,
        )
        return self._triton_attention(query, kv_cache, attn_metadata)

    def _bound_cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise ValueError("kv_caches: no KV cache bound; call model.bind_kv_caches first")
        return self.kv_cache

    def _triton_attention(
        self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        return self._attention_kernels.paged_attention(
            query,
            kv_cache,
            attn_metadata.block_tables,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.max_query_len,
            attn_metadata.max_seq_len,
            self.scale,
            out,
            attn_metadata.split_kv_workspace,
        )
