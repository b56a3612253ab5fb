"""How many KV blocks fit, and the per-layer cache tensors.

Per layer the cache is `[2, num_blocks, block_size, num_kv_heads, head_dim]`, with this rank's
KV heads under tensor parallelism (`tp_size`); block 0 is the padding block that the KV manager
never hands out.
"""

from __future__ import annotations

import torch

from ferrum.config import CacheConfig, ModelConfig, SchedulerConfig, kv_heads_per_rank

# The CPU pool's default cap: memory for development runs, not for throughput.
CPU_DEFAULT_KV_BYTES = 512 << 20
_GIB = float(1 << 30)


def kv_bytes_per_block(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return (
        2
        * model_config.num_hidden_layers
        * block_size
        * kv_heads_per_rank(model_config.num_kv_heads, tp_size)
        * model_config.head_dim
        * element_size
    )


def blocks_worth_keeping(scheduler_config: SchedulerConfig, block_size: int) -> int:
    """Enough blocks for every sequence slot at full length (+ the padding block): more is waste."""
    blocks_per_seq = -(-scheduler_config.max_model_len // block_size)
    return scheduler_config.max_num_seqs * blocks_per_seq + 1


def num_blocks_from_budget(
    budget_bytes: int,
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    dtype: torch.dtype,
    cap_to_need: bool = False,
    tp_size: int = 1,
) -> int:
    """Blocks that fit in `budget_bytes` (at most what every sequence slot at full length needs,
    with `cap_to_need`); fails with the numbers to change if one sequence can't fit."""
    block_size = cache_config.block_size
    per_block = kv_bytes_per_block(model_config, block_size, dtype, tp_size)
    num_blocks = budget_bytes // per_block
    if cap_to_need:
        num_blocks = min(num_blocks, blocks_worth_keeping(scheduler_config, block_size))
    needed = -(-scheduler_config.max_model_len // block_size) + 1
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache budget of {budget_bytes / _GIB:.2f} GiB holds {num_blocks} blocks of "
            f"{block_size} tokens, but one sequence of max_model_len={scheduler_config.max_model_len} "
            f"needs {needed} ({needed * per_block / _GIB:.2f} GiB): lower max_model_len, or raise "
            f"gpu_memory_utilization / kv_cache_memory_bytes"
        )
    return int(num_blocks)


def cpu_kv_budget(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    dtype: torch.dtype,
    tp_size: int = 1,
) -> int:
    """kv_cache_memory_bytes when set; else what every sequence slot at full length needs, at
    most CPU_DEFAULT_KV_BYTES but at least one sequence of max_model_len."""
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    block_size = cache_config.block_size
    per_block = kv_bytes_per_block(model_config, block_size, dtype, tp_size)
    one_sequence = (-(-scheduler_config.max_model_len // block_size) + 1) * per_block
    every_slot = blocks_worth_keeping(scheduler_config, block_size) * per_block
    return max(min(every_slot, CPU_DEFAULT_KV_BYTES), one_sequence)


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int = 1,
) -> list[torch.Tensor]:
    num_kv_heads = kv_heads_per_rank(model_config.num_kv_heads, tp_size)
    shape = (2, num_blocks, block_size, num_kv_heads, model_config.head_dim)
    return [
        torch.zeros(shape, dtype=dtype, device=device)
        for _ in range(model_config.num_hidden_layers)
    ]
