"""Causal attention of long fresh prompts through torch's SDPA (cuDNN's fused attention first).

A request whose chunk is its whole context (no prefix-cache hit, first chunk) needs no paged KV:
its rotated q, k and v are at hand. On the H100, cuDNN's attention ran an 8,000-token prompt at
Qwen3 shapes in 0.86 ms a layer against 2.14 ms for ferrum's Triton kernel and 1.64 ms for
FlashAttention-2 (benchmarks/bench_prefill_attention.py). The layer sends each request that is
fresh and at least SDPA_PREFILL_MIN_TOKENS long through SDPA, and the runs of other requests
between them (decodes, later chunks) through the paged kernel (`long_prefill_segments`). Such
steps are never replayed from a CUDA graph (those hold at most 512 tokens). Each request runs on
its own, on [1, heads, L, head_dim] views of the step's rows, the KV heads not repeated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Shortest chunk that takes SDPA; CUDA graphs replay prefill chunks of at most 512 tokens.
SDPA_PREFILL_MIN_TOKENS = 2048
# In priority order. Never the math backend: it materialises the [heads, L, L] scores.
PREFILL_BACKENDS = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)


def sdpa_prefill_applies(query: torch.Tensor, max_query_len: int) -> bool:
    """A GPU step in fp16/bf16 with a head size both backends take (a multiple of 8, at most
    256) whose longest chunk could take SDPA; `long_prefill_segments` then says which do."""
    head_dim = query.shape[-1]
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    return head_dim % 8 == 0 and head_dim <= 256 and max_query_len >= SDPA_PREFILL_MIN_TOKENS


@dataclass(frozen=True)
class AttentionSegment:
    """Requests [first, last) of a step, contiguous in token order: long fresh prompts for SDPA
    (`sdpa`), or other requests (decodes, later chunks, short prompts) for the paged kernel."""

    first: int
    last: int
    sdpa: bool


def long_prefill_segments(
    query_start_loc: Sequence[int], seq_lens: Sequence[int]
) -> list[AttentionSegment]:
    """The step cut into maximal runs of requests that do and do not take SDPA; empty when none
    does. A request takes it when its chunk is its whole context (a first chunk without a prefix
    cache hit) and at least SDPA_PREFILL_MIN_TOKENS long."""
    segments: list[AttentionSegment] = []
    any_sdpa = False
    for i, seq_len in enumerate(seq_lens):
        chunk = query_start_loc[i + 1] - query_start_loc[i]
        sdpa = chunk == seq_len and chunk >= SDPA_PREFILL_MIN_TOKENS
        any_sdpa = any_sdpa or sdpa
        if segments and segments[-1].sdpa == sdpa:
            segments[-1] = AttentionSegment(segments[-1].first, i + 1, sdpa)
        else:
            segments.append(AttentionSegment(i, i + 1, sdpa))
    return segments if any_sdpa else []


def sdpa_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], after RoPE
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], after RoPE
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    query_start_loc: Sequence[int],  # [num_reqs + 1], on the host
    scale: float,
    out: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]
    backends: Sequence[SDPBackend] = PREFILL_BACKENDS,
) -> torch.Tensor:
    """Each request's causal attention over its own tokens, written into and returned as `out`;
    with `out=None` (one request only) SDPA's own output is returned, saving the copy."""
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        # The loop over requests is host code: a graph would replay the capture's lengths.
        raise RuntimeError("sdpa_prefill cannot be captured in a CUDA graph")
    if out is None and len(query_start_loc) != 2:
        raise ValueError(f"out: None takes one request, got {len(query_start_loc) - 1}")
    with sdpa_kernel(list(backends), set_priority=True):
        for start, end in zip(query_start_loc[:-1], query_start_loc[1:]):
            # [1, heads, tokens, head_dim] views of the step's rows: no copies; the backends
            # take these strides and KV heads shared by a group of query heads.
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )[0].transpose(0, 1)
            if out is None:
                return o.contiguous()  # a no-op when SDPA wrote the query's token-major layout
            out[start:end].copy_(o)
    return out
