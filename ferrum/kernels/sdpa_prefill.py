"""Causal attention of long prompt chunks through torch's SDPA, cuDNN first (H100, 8,000 tokens at
Qwen3 shapes: 0.86 ms a layer, the Triton kernel 2.14, FlashAttention-2 1.64). Chunks of at least
SDPA_PREFILL_MIN_TOKENS after a cached prefix of at most PREFIX_PER_CHUNK chunks take SDPA one
request at a time, the runs between the paged kernel (`long_prefill_segments`); such steps never
replay a CUDA graph (at most 512 tokens). SDPA's causal mask is top-left aligned, so after a prefix
of p tokens the chunk fills rows [p, p + chunk) of a square problem over the context (K, V from the
cache): cheaper than the paged kernel below p = 3 x chunk (~600 vs ~240 TFLOP/s; PREFIX_PER_CHUNK =
2 kept 1.39x+). Not after a prefix where cuDNN rejects the shape (`cudnn_takes`). cuDNN plans per
shape, so requests are padded into fixed buffers (`padded_length`) planned at start-up."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ferrum.kernels import cuda_capability

# Shortest chunk that takes SDPA; CUDA graphs replay prefill chunks of at most 512 tokens.
SDPA_PREFILL_MIN_TOKENS = 2048
# Longest cached prefix, in chunks, before which a chunk still takes SDPA (the module's cost rule).
PREFIX_PER_CHUNK = 2
# In priority order. Never the math backend: it materialises the [heads, L, L] scores.
PREFILL_BACKENDS = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)
CUDNN_ONLY = (SDPBackend.CUDNN_ATTENTION,)
# The shortest padded length serving uses, whose plan start-up builds anyway; a constant, not
# SDPA_PREFILL_MIN_TOKENS (which tests raise to turn SDPA off).
_CUDNN_PROBE_TOKENS = 2048


def long_chunk_in_step(max_query_len: int) -> bool:
    """Whether a step's longest chunk is long enough for SDPA (`long_prefill_segments` then says
    which requests take it)."""
    return max_query_len >= SDPA_PREFILL_MIN_TOKENS


def sdpa_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """An Ampere or newer GPU (cuDNN's and flash's fused attention need sm80), fp16/bf16, and a
    head size both backends take (a multiple of 8, at most 256)."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0
        and head_dim <= 256
        and cuda_capability(device.index) >= (8, 0)
    )


@dataclass(frozen=True)
class AttentionSegment:
    """Requests [first, last) of a step, contiguous in token order: long chunks for SDPA
    (`sdpa`), or other requests (decodes, short chunks, chunks after a long prefix) for the
    paged kernel, with their longest chunk and context."""

    first: int
    last: int
    sdpa: bool
    max_query_len: int
    max_seq_len: int


def long_prefill_segments(
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    max_len: int,
    prefix_per_chunk: int = PREFIX_PER_CHUNK,
) -> tuple[AttentionSegment, ...]:
    """The step cut into maximal runs of requests that do and do not take SDPA (empty when none
    does): those with a chunk of at least SDPA_PREFILL_MIN_TOKENS, a cached prefix of at most
    `prefix_per_chunk` chunks (0: fresh chunks only) and a context of at most `max_len` tokens
    (start-up plans every padded length up to it; the memory profile covers a buffer that long)."""
    segments: list[AttentionSegment] = []
    any_sdpa = False
    for i, seq_len in enumerate(seq_lens):
        chunk = query_start_loc[i + 1] - query_start_loc[i]
        sdpa = (
            chunk >= SDPA_PREFILL_MIN_TOKENS
            and seq_len - chunk <= prefix_per_chunk * chunk
            and seq_len <= max_len
        )
        any_sdpa = any_sdpa or sdpa
        last = segments[-1] if segments else None
        if last is not None and last.sdpa == sdpa:
            segments[-1] = AttentionSegment(
                last.first,
                i + 1,
                sdpa,
                max(last.max_query_len, chunk),
                max(last.max_seq_len, seq_len),
            )
        else:
            segments.append(AttentionSegment(i, i + 1, sdpa, chunk, seq_len))
    return tuple(segments) if any_sdpa else ()


def padded_length(length: int) -> int:
    """`length` rounded up to an eighth of its power-of-two octave (2,048-4,096 in steps of 256,
    4,096-8,192 in steps of 512, ...): the lengths SDPA runs at, at most 12.5% over."""
    step = 1 << max(length.bit_length() - 4, 0)
    return -(-length // step) * step


def padded_lengths(max_tokens: int) -> list[int]:
    """Every `padded_length` of a chunk of SDPA_PREFILL_MIN_TOKENS to `max_tokens` tokens."""
    lengths: list[int] = []
    length = SDPA_PREFILL_MIN_TOKENS
    while length <= max_tokens:
        lengths.append(padded_length(length))
        length = lengths[-1] + 1
    return lengths


@dataclass(frozen=True)
class CachedContext:
    """Where the chunks of an SDPA call read a cached prefix from: the layer's paged cache, and
    the block table row and context length of each request of the call."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: Sequence[int]  # [num_reqs], on the host


def sdpa_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], after RoPE
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], after RoPE
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    query_start_loc: Sequence[int],  # [num_reqs + 1], on the host
    scale: float,
    out: torch.Tensor | None,  # [num_tokens, num_heads, head_dim]
    backends: Sequence[SDPBackend] = PREFILL_BACKENDS,
    context: CachedContext | None = None,
) -> torch.Tensor:
    """Each request's causal attention over its context, written into and returned as `out`;
    with `out=None` (one request only) the rows of SDPA's own output are returned. Without
    `context` every chunk is its request's whole context; with it, a request whose context is
    longer than its chunk reads its keys and values from the cache (see the module)."""
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        # The loop over requests is host code: a graph would replay the capture's lengths.
        raise RuntimeError("sdpa_prefill cannot be captured in a CUDA graph")
    if out is None and len(query_start_loc) != 2:
        raise ValueError(f"out: None takes one request, got {len(query_start_loc) - 1}")
    with sdpa_kernel(list(backends), set_priority=True):
        for i, (start, end) in enumerate(zip(query_start_loc[:-1], query_start_loc[1:])):
            length = end - start
            prefix = 0 if context is None else context.seq_lens[i] - length
            assert prefix >= 0, (prefix, length)
            if prefix:
                assert context is not None
                q, k, v = pack_padded_from_cache(
                    query[start:end], context.kv_cache, context.block_tables[i], prefix
                )
            else:
                q, k, v = pack_padded(query[start:end], key[start:end], value[start:end])
            o = F.scaled_dot_product_attention(
                *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )[0].transpose(0, 1)[prefix : prefix + length]
            if out is None:
                # A no-op when SDPA wrote the query's token-major layout; after a prefix the
                # view keeps the whole padded output alive until the layer's caller is done.
                return o.contiguous()
            out[start:end].copy_(o)
            # Freed before the next request's buffer: the peak stays one padded request.
            del q, k, v, o
    return out


def pack_padded(
    query: torch.Tensor,  # [length, heads, head_dim], one request's rows
    key: torch.Tensor,  # [length, kv_heads, head_dim]
    value: torch.Tensor,  # [length, kv_heads, head_dim]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v copied into one new [padded_length, heads | kv_heads | kv_heads, head_dim]
    token-major buffer, rows past `length` zero (causal: no real query sees their keys; zeros, not
    garbage, as a NaN value times a zero weight is NaN). SDPA always sees this layout, so cuDNN
    needs one plan per padded length (built at start-up), whatever the projections' layout. On a
    GPU one Triton launch (`kernels/pack_padded.py`) does these copies."""
    length, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    packed = query.new_empty(padded_length(length), heads + 2 * kv_heads, head_dim)
    if query.is_cuda:
        # Imported here: a CPU engine on the torch backend need not have Triton.
        from ferrum.kernels.pack_padded import pack_padded_rows

        pack_padded_rows(packed, query, key, value)
    else:
        packed[length:].zero_()
        for dst, src in zip(
            packed[:length].split([heads, kv_heads, kv_heads], 1), (query, key, value)
        ):
            dst.copy_(src)
    return packed.split([heads, kv_heads, kv_heads], dim=1)


def pack_padded_from_cache(
    query: torch.Tensor,  # [chunk, heads, head_dim], the rows after a cached prefix
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks] int32, the request's
    prefix: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_padded`'s layout over the whole context of `prefix + chunk` tokens: query rows
    [prefix, prefix + chunk) hold `query`, earlier ones zero; every context row's key and value
    come from the cache through `block_table`; rows past the context are zero. On a GPU one
    Triton launch (`kernels/pack_padded.py`) does what the torch gather here does."""
    chunk, heads, head_dim = query.shape
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    seq_len = prefix + chunk
    packed = query.new_empty(padded_length(seq_len), heads + 2 * kv_heads, head_dim)
    if query.is_cuda:
        from ferrum.kernels.pack_padded import pack_padded_rows_from_cache

        pack_padded_rows_from_cache(packed, query, kv_cache, block_table, prefix)
    else:
        packed.zero_()
        tokens = torch.arange(seq_len, device=query.device)
        blocks = block_table.long()[tokens // block_size]
        packed[prefix:seq_len, :heads] = query
        packed[:seq_len, heads:] = (
            kv_cache[:, blocks, tokens % block_size].transpose(0, 1).flatten(1, 2)
        )
    return packed.split([heads, kv_heads, kv_heads], dim=1)


def warm_up_sdpa_prefill(
    heads: int,
    kv_heads: int,
    head_dim: int,
    scale: float,
    dtype: torch.dtype,
    device: torch.device,
    max_tokens: int,
) -> int:
    """Runs SDPA once at every padded length up to `max_tokens`, so that cuDNN builds (and torch
    caches) each length's execution plan before serving; returns the number of lengths. torch
    keeps those plans per thread: serving must run forwards on the thread that ran this."""
    lengths = padded_lengths(max_tokens)
    for length in lengths:
        query = torch.zeros(length, heads, head_dim, dtype=dtype, device=device)
        key = torch.zeros(length, kv_heads, head_dim, dtype=dtype, device=device)
        sdpa_prefill(query, key, key, [0, length], scale, None)
    return len(lengths)


def warm_up_cached_pack(heads: int, kv_cache: torch.Tensor) -> None:
    """Runs `pack_padded_from_cache` once over `kv_cache` (read only) for a layer of `heads`
    query heads: its Triton gather compiles per layer shape and cache layout, and no warm-up
    forward has a cached prefix before a long chunk."""
    head_dim, block_size = kv_cache.shape[4], kv_cache.shape[2]
    query = torch.zeros(block_size, heads, head_dim, dtype=kv_cache.dtype, device=kv_cache.device)
    table = torch.zeros(2, dtype=torch.int32, device=kv_cache.device)
    pack_padded_from_cache(query, kv_cache, table, block_size)


def cudnn_takes(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether cuDNN's attention runs this shape (SDPA with cuDNN alone, at _CUDNN_PROBE_TOKENS),
    rather than SDPA falling back to FlashAttention-2."""
    query = torch.zeros(_CUDNN_PROBE_TOKENS, heads, head_dim, dtype=dtype, device=device)
    key = torch.zeros(_CUDNN_PROBE_TOKENS, kv_heads, head_dim, dtype=dtype, device=device)
    try:
        sdpa_prefill(query, key, key, [0, _CUDNN_PROBE_TOKENS], 1.0, None, CUDNN_ONLY)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:  # "No available kernel"
        return False
    return True
