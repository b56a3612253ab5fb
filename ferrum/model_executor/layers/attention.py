"""Paged attention layer: writes this step's K/V into the layer's cache, then attends over it.

The cache per layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`, bound once by the
model runner through `bind_kv_cache`. Kernel calls sit behind `write_kv_cache` and
`paged_attention` so a Triton backend can replace the torch reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref

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
        if self.kv_cache is None:
            raise ValueError("kv_caches: no KV cache bound; call model.bind_kv_caches first")
        write_kv_cache(key, value, self.kv_cache, attn_metadata.slot_mapping)
        return paged_attention(query, self.kv_cache, attn_metadata, self.scale)
