"""Paged attention layer: one kernel call writes this step's K/V into the layer's cache (fused with
RoPE and the optional q/k norm), then attention reads it. The runner binds the cache
`[2, num_blocks, block_size, num_kv_heads, head_dim]`. With Triton on sm80+, long prompt chunks
after no or a short cached prefix attend through SDPA (`kernels/sdpa_prefill.py`), unless the
layer has a sliding window, an FP8 cache (its prefill reads the rounded K/V back) or a head size
SDPA's fused backends reject (`takes_sdpa_prefill`). A layer given FlashAttention-4
(`use_flash_attention`) runs it instead on the steps that metadata marks
(`flash_attention_step`: much prompt attention, no CUDA graph; `kernels/flash_attn4.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.kernels import FP8_KV_DTYPE
from ferrum.kernels.interface import Kernels
from ferrum.kernels.sdpa_prefill import (
    AttentionSegment,
    CachedContext,
    sdpa_prefill,
    sdpa_takes,
)
from ferrum.model_executor.layers.layernorm import RMSNorm

if TYPE_CHECKING:
    from ferrum.kernels.flash_attn4 import FlashAttention4
    from ferrum.kernels.fp8_quant import Fp8GroupRows
    from ferrum.kernels.paged_attention import SplitKVWorkspace
    from ferrum.model_executor.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        kernels: Kernels,
        sliding_window: int | None = None,
    ) -> None:
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
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1, got {sliding_window}")
        # Each query attends to its last `sliding_window` positions (None: all of them).
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None
        # The KV cache group whose block tables and slots this layer's cache is addressed by.
        self.kv_cache_group = 0
        # Scratch of the Triton split-KV decode path, owned by the runner and shared by every
        # layer (they run one after another); None disables that path.
        self.split_kv_workspace: SplitKVWorkspace | None = None
        self.kernels = kernels
        # Set by the runner where FlashAttention-4 takes this layer (kernel_backend.py).
        self.flash_attention: FlashAttention4 | None = None
        self._writes_fp8_rows = False
        if kernels.is_triton:
            from ferrum.kernels.fp8_quant import GROUP_SIZE  # imports triton, as the kernels do

            self._writes_fp8_rows = head_dim == GROUP_SIZE

    def bind_kv_cache(
        self,
        kv_cache: torch.Tensor,
        split_kv_workspace: SplitKVWorkspace | None = None,
        kv_cache_group: int = 0,
    ) -> None:
        expected = (2, self.num_kv_heads, self.head_dim)
        found = (kv_cache.shape[0], *kv_cache.shape[3:]) if kv_cache.dim() == 5 else None
        if found != expected:
            raise ValueError(
                "kv_caches: each layer's cache must be [2, num_blocks, block_size, "
                f"{self.num_kv_heads}, {self.head_dim}], got {list(kv_cache.shape)}"
            )
        self.kv_cache = kv_cache
        self.split_kv_workspace = split_kv_workspace
        self.kv_cache_group = kv_cache_group

    def unbind_kv_cache(self) -> None:
        """Drops the bound cache and its split-KV scratch (an empty `bind_kv_caches`)."""
        self.kv_cache = self.split_kv_workspace = None

    def use_flash_attention(self, flash_attention: FlashAttention4 | None) -> None:
        """The steps metadata marks (`flash_attention_step`) attend through `flash_attention`
        (None: through SDPA and the paged kernel)."""
        self.flash_attention = flash_attention

    def takes_sdpa_prefill(self) -> bool:
        """Whether long prompt chunks attend through SDPA here: Triton kernels, no sliding
        window, a bound bf16/fp16 cache (an FP8 cache's prefill reads the rounded keys back) on
        a GPU SDPA's fused backends take; never with batch-invariant kernels. With
        FlashAttention-4 too, on the steps it does not take (a fresh chunk of 2,048 tokens
        is short of FA4_MIN_PAIRS)."""
        cache = self.kv_cache
        return (
            self.kernels.is_triton
            and not self.kernels.batch_invariant
            and self.sliding_window is None
            and cache is not None
            and cache.dtype != FP8_KV_DTYPE
            and sdpa_takes(cache.device, cache.dtype, self.head_dim)
        )

    def sdpa_prefill_shape(self) -> tuple[int, int, int, float, torch.dtype, torch.device] | None:
        """(heads, KV heads, head_dim, scale, dtype, device) when `takes_sdpa_prefill`, for the
        runner's start-up to build SDPA's plans; else None."""
        if not self.takes_sdpa_prefill():
            return None
        assert self.kv_cache is not None
        return (
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.scale,
            self.kv_cache.dtype,
            self.kv_cache.device,
        )

    def writes_fp8_rows(self) -> bool:
        """Whether `forward(..., out_fp8=rows)` fills rows: with the Triton kernels and heads of
        128 (one quantization group a head), on every step. The paged kernels write the output
        quantized as well; SDPA's prompts are quantized by a pass of their own."""
        return self._writes_fp8_rows

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], before RoPE
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], before RoPE
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos: torch.Tensor,  # [num_tokens, head_dim // 2] float32
        sin: torch.Tensor,  # [num_tokens, head_dim // 2] float32
        attn_metadata: AttentionMetadata,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        out_fp8: Fp8GroupRows | None = None,
    ) -> torch.Tensor:
        """Optional per-head q/k RMSNorm, RoPE, the KV write, then attention over the cache.
        Returns [num_tokens, num_heads, head_dim]; fills `out_fp8` (the output's
        [num_tokens, num_heads * head_dim] rows quantized per token-group of 128) where
        `writes_fp8_rows` says so."""
        kv_cache = self.kv_cache
        if kv_cache is None:
            raise ValueError("kv_caches: no KV cache bound; call model.bind_kv_caches first")
        q_norm_weight = None if q_norm is None else q_norm.weight
        k_norm_weight = None if k_norm is None else k_norm.weight
        eps = 1e-6 if q_norm is None else q_norm.eps
        group = self.kv_cache_group
        if out_fp8 is not None and not self.writes_fp8_rows():
            raise ValueError("out_fp8: this attention layer does not write FP8 rows")
        self.kernels.rotary_kv(
            query,
            key,
            value,
            cos,
            sin,
            kv_cache,
            attn_metadata.slot_mapping[group],
            q_norm_weight=q_norm_weight,
            k_norm_weight=k_norm_weight,
            eps=eps,
        )
        if self.flash_attention is not None and attn_metadata.flash_attention_step:
            out = self.flash_attention(
                query,
                kv_cache,
                attn_metadata.block_tables[group],
                attn_metadata.query_start_loc,
                attn_metadata.seq_lens,
                attn_metadata.max_query_len,
                self.scale,
                self.sliding_window,
            )
            _quantize_rows_into(out_fp8, out, slice(0, out.shape[0]))
            return out
        if attn_metadata.prefill_segments and self.takes_sdpa_prefill():
            return self._attend_by_segments(
                query, key, value, attn_metadata, attn_metadata.prefill_segments, out_fp8
            )
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        return self.kernels.paged_attention(
            query,
            kv_cache,
            attn_metadata.block_tables[group],
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            attn_metadata.max_query_len,
            attn_metadata.max_seq_len,
            self.scale,
            out,
            self.split_kv_workspace,
            sliding_window=self.sliding_window,
            out_fp8=out_fp8,
        )

    def _attend_by_segments(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: AttentionMetadata,
        segments: Sequence[AttentionSegment],
        out_fp8: Fp8GroupRows | None = None,
    ) -> torch.Tensor:
        """Long chunks through SDPA (a cached prefix read from this layer's cache), the runs of
        requests between them through the paged kernel, each onto its own rows of the output
        (and of `out_fp8`: the paged kernel writes its rows, SDPA's are quantized after it).
        Only where `takes_sdpa_prefill` (no window: the paged calls pass none)."""
        assert self.kv_cache is not None
        starts = attn_metadata.query_start_loc_cpu
        group = self.kv_cache_group

        def context(first: int, last: int) -> CachedContext:
            assert self.kv_cache is not None
            return CachedContext(
                self.kv_cache,
                attn_metadata.block_tables[group][first:last],
                attn_metadata.seq_lens_cpu[first:last],
            )

        if len(starts) == 2 and starts[1] == query.shape[0]:  # one prompt: SDPA's own output
            out = sdpa_prefill(query, key, value, starts, self.scale, None, context=context(0, 1))
            _quantize_rows_into(out_fp8, out, slice(0, out.shape[0]))
            return out
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        for segment in segments:
            first, last = segment.first, segment.last
            rows = slice(starts[first], starts[last])
            if segment.sdpa:
                local_starts = [start - starts[first] for start in starts[first : last + 1]]
                sdpa_prefill(
                    query[rows],
                    key[rows],
                    value[rows],
                    local_starts,
                    self.scale,
                    out[rows],
                    context=context(first, last),
                )
                _quantize_rows_into(out_fp8, out, rows)
                continue
            query_start_loc = attn_metadata.query_start_loc[first : last + 1]
            if first:
                query_start_loc = query_start_loc - starts[first]
            self.kernels.paged_attention(
                query[rows],
                self.kv_cache,
                attn_metadata.block_tables[group][first:last],
                query_start_loc,
                attn_metadata.seq_lens[first:last],
                segment.max_query_len,
                segment.max_seq_len,
                self.scale,
                out[rows],
                self.split_kv_workspace,
                out_fp8=None if out_fp8 is None else out_fp8.rows(rows),
            )
        return out


def bind_single_cache(
    attn: Attention,
    kv_caches: Sequence[torch.Tensor],
    split_kv_workspace: SplitKVWorkspace | None = None,
    kv_cache_groups: Sequence[int] | None = None,
) -> None:
    """A one-layer model's `bind_kv_caches` (a speculative head's): `attn` takes the one cache
    and its group (default 0); an empty list unbinds it."""
    if not kv_caches:
        attn.unbind_kv_cache()
        return
    group = 0 if kv_cache_groups is None else kv_cache_groups[0]
    attn.bind_kv_cache(kv_caches[0], split_kv_workspace, group)


def _quantize_rows_into(out_fp8: Fp8GroupRows | None, out: torch.Tensor, rows: slice) -> None:
    """out_fp8's `rows` := out's [rows] ([T, heads, head_dim]) quantized per token-group of 128,
    the codes and scales the paged kernels would write (the same per-group pass). The pass
    writes fresh tensors, then they are copied: a slice's scales may start at any 4 bytes, and
    writing them in place would compile an alignment variant warm-up never ran."""
    if out_fp8 is None:
        return
    from ferrum.kernels.fp8_quant import per_token_group_quant_fp8

    part = out[rows]
    q, scales = per_token_group_quant_fp8(part.reshape(part.shape[0], -1))
    target = out_fp8.rows(rows)
    target.q.copy_(q)
    target.scales.copy_(scales)
