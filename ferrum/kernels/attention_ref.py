"""Torch reference for paged attention: the CPU path and the Triton kernels' oracle. KV cache per
layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (keys, values); slot s is at block
s // block_size, offset s % block_size.
"""

from __future__ import annotations

import torch


def write_kv_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """kv_cache[:, slot] = (key[t], value[t]) for each token t (into an FP8 cache saturated to
    +-448, as the Triton cache writers do)."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    if kv_cache.dtype == torch.float8_e4m3fn:
        # Saturate first (the cast gives NaN past +-448 on CUDA); no index_copy_ for FP8: bytes.
        key, value = (_saturate_fp8(t).view(torch.uint8) for t in (key, value))
        flat = flat.view(torch.uint8)
    key, value = key.to(flat.dtype), value.to(flat.dtype)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _saturate_fp8(x: torch.Tensor) -> torch.Tensor:
    limit = torch.finfo(torch.float8_e4m3fn).max
    return x.float().clamp(-limit, limit).to(torch.float8_e4m3fn)


def paged_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: list[int],  # [num_reqs + 1], host
    seq_lens: list[int],  # [num_reqs], host
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query chunk over its paged context, in fp32 math;
    [num_tokens, num_heads, head_dim] in the query's dtype. Query j of a chunk of q tokens over L
    context sits at p = L - q + j and sees 0..p, or p - W + 1..p with `sliding_window` W; blocks
    wholly below the chunk's first window are never read (a sliding-window cache may free them).
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        first_key = 0
        if sliding_window is not None:
            first_key = max(0, seq_len - q_len - sliding_window + 1)
        first_block = first_key // block_size
        base = first_block * block_size  # position of the first key gathered
        blocks = block_tables[i, first_block:num_blocks].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[: seq_len - base]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[: seq_len - base]
        q = query[start:end].float().transpose(0, 1)  # [H, q_len, D]
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, q_len, L]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(base, seq_len, device=query.device)
        mask = k_pos[None, :] > q_pos[:, None]
        if sliding_window is not None:
            mask |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(query.dtype)
    return out


def paged_attention_query_by_query_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: list[int],  # [num_reqs + 1], host
    seq_lens: list[int],  # [num_reqs], host
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """`paged_attention_ref` one query token at a time, over exactly the keys it sees, as a
    decode of it would run: a token's result depends on nothing else in the step (the
    batch-invariant torch path; each token copied to its own buffer, whatever its alignment)."""
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, q_len = query_start_loc[i], query_start_loc[i + 1] - query_start_loc[i]
        for j in range(q_len):
            token, visible = start + j, seq_len - q_len + j + 1
            out[token] = paged_attention_ref(
                query[token : token + 1].clone(), kv_cache, block_tables[i : i + 1], [0, 1],
                [visible], scale, sliding_window,
            )[0]  # fmt: skip
    return out
