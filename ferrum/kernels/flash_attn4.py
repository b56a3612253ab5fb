"""FlashAttention-4 (the `flash-attn-4` package's CuTe-DSL kernels: `pip install 'ferrum[fa4]'`)
for steps with much prompt attention, on Hopper and Blackwell. One varlen launch covers the whole
step (chunks after any cached prefix, fresh prompts, the step's decodes) straight from the paged
cache through the block tables. H200, Qwen3-8B heads, pages of 16 (TFLOP/s,
benchmarks/bench_chunk_attention.py; prefix:chunk x conversations): after a cached prefix
630-640 where ferrum's paged Triton kernel runs ~240 (3k:512 x8, 3k:1k x8, 8k:2k, 16k:4k); fresh
8k 628 against cuDNN's 570; but 3k:512 x1 190 against 234 and 0:512 x8 107 against 142. So a
step takes it when its chunks attend over at least FA4_MIN_PAIRS (query, key) pairs (lost at
1.8M, won from 4.2M), never decode-only steps (split-KV read 4.3-4.5 TB/s at 2k-8k context, 3.5-3.8
here) nor steps replayed from CUDA graphs (`flash_attention_step`). The kernels compile (JIT) once
per layer shape, at warm-up, or load from disk (`load_flash_attn4`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ferrum import envs

# The (query, key) pairs of a step's prompt chunks from which it attends through FlashAttention-4.
FA4_MIN_PAIRS = 3 << 20
NOT_INSTALLED = "needs the flash-attn-4 package (pip install 'ferrum[fa4]')"
# The compute capabilities (major) FlashAttention-4's paged forward runs on: sm90, sm100/sm110.
_MAJORS = (9, 10, 11)


def flash_attention_step(query_start_loc: Sequence[int], seq_lens: Sequence[int]) -> bool:
    """Whether a step (not replayed from a CUDA graph) attends through FlashAttention-4: its
    prompt chunks (requests of more than one query) see at least FA4_MIN_PAIRS keys in all."""
    pairs = 0
    for start, end, seq_len in zip(query_start_loc, query_start_loc[1:], seq_lens):
        chunk = end - start
        if chunk > 1:
            pairs += chunk * (seq_len - chunk) + chunk * (chunk + 1) // 2
    return pairs >= FA4_MIN_PAIRS


def load_flash_attn4() -> tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]] | None, str]:
    """(`flash_attn.cute`'s `flash_attn_varlen_func`, "") or (None, why it cannot be had: not
    installed, or installed with native libraries that do not load). Its compiled kernels
    persist on disk (`envs.persist_flash_attn4_kernels`). The import takes ~7 s (H200 box)."""
    envs.persist_flash_attn4_kernels()
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except ImportError:
        return None, NOT_INSTALLED
    except (OSError, RuntimeError) as e:
        return None, f"is installed but does not load: {e}"
    return flash_attn_varlen_func, ""


def flash_attn4_rejects(
    capability: tuple[int, int], dtype: torch.dtype, kv_cache_dtype: torch.dtype, head_dim: int
) -> str | None:
    """Why FlashAttention-4 cannot run a layer of this shape here (None: it can)."""
    if capability[0] not in _MAJORS:
        return f"needs a Hopper or Blackwell GPU (compute capability 9.x-11.x), got {capability}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"needs a bfloat16 or float16 model, got {dtype}"
    if kv_cache_dtype != dtype:
        return f"needs the KV cache in the model's dtype, got {kv_cache_dtype}"
    # sm90: multiples of 8 up to 256; Blackwell: up to 128, or 256.
    if head_dim % 8 or head_dim > 256 or (capability[0] > 9 and 128 < head_dim < 256):
        return f"does not take heads of {head_dim} on compute capability {capability[0]}.x"
    return None


class FlashAttention4:
    """ferrum's paged-attention contract over `flash_attn_varlen_func` (see the module)."""

    def __init__(self, varlen_func: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.varlen_func = varlen_func

    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
        query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
        seq_lens: torch.Tensor,  # [num_reqs] int32
        max_query_len: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """[num_tokens, num_heads, head_dim]: causal attention of each request's chunk over its
        context (the chunk is the context's last tokens), with `sliding_window` W over the
        last W positions only."""
        window = (None, None) if sliding_window is None else (sliding_window - 1, 0)
        out, _ = self.varlen_func(
            query,
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=query_start_loc,
            seqused_k=seq_lens,
            max_seqlen_q=max_query_len,
            page_table=block_tables,
            softmax_scale=scale,
            causal=True,
            window_size=window,
        )
        return out
