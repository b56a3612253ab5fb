"""How many KV blocks fit per layer group, and the per-layer caches `[2, num_blocks, block_size,
num_kv_heads, head_dim]` (this rank's KV heads; block 0 of every pool is padding, never handed out).
A budget splits between groups by what one max_model_len sequence holds in each (a sliding window
its window only); a pipeline stage counts only its own layers (`layer_ids`). Recurrent layers get
state pools instead (conv `[num_slots, conv_width - 1, conv_dim]` in the model dtype, recurrent
`[num_slots, num_v_heads, k_dim, v_dim]` fp32, slot 0 padding): max_num_seqs + 1 slots, plus
max_num_seqs for snapshots with prefix caching, within half the budget, before attention's split."""

from __future__ import annotations

import torch

from ferrum.config import CacheConfig, ModelConfig, SchedulerConfig
from ferrum.kv.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups, layer_group_ids
from ferrum.model_arch import ModelArchConfig
from ferrum.parallel_config import kv_heads_per_rank

# The recurrent (gated DeltaNet) state is kept in float32: it accumulates over the whole sequence.
RECURRENT_STATE_DTYPE = torch.float32

# Blocks of a group a rank holds no layer of: it fits any count (the other ranks' sizes decide).
UNBOUNDED_BLOCKS = 1 << 40

# The CPU pool's default cap: memory for development runs, not for throughput.
CPU_DEFAULT_KV_BYTES = 512 << 20
_GIB = float(1 << 30)


def kv_cache_group_specs(model_config: ModelConfig) -> tuple[KVCacheGroupSpec, ...]:
    """The model's layer groups: full attention first, then one per sliding window."""
    arch = model_config.arch
    return kv_cache_groups(
        [arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)],
        arch.linear_attention_layers,
    )


def recurrent_state_shapes(arch: ModelArchConfig) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """Per slot of one linear-attention layer: (conv state shape, recurrent state shape)."""
    conv_dim = (
        2 * arch.linear_num_key_heads * arch.linear_key_head_dim
        + arch.linear_num_value_heads * arch.linear_value_head_dim
    )
    return (arch.linear_conv_kernel_dim - 1, conv_dim), (
        arch.linear_num_value_heads,
        arch.linear_key_head_dim,
        arch.linear_value_head_dim,
    )


def _recurrent_slot_bytes(arch: ModelArchConfig, dtype: torch.dtype) -> int:
    (width, conv_dim), (heads, k_dim, v_dim) = recurrent_state_shapes(arch)
    conv = width * conv_dim * torch.empty((), dtype=dtype).element_size()
    state = heads * k_dim * v_dim * torch.empty((), dtype=RECURRENT_STATE_DTYPE).element_size()
    return conv + state


def group_bytes_per_block(
    model_config: ModelConfig,
    group: KVCacheGroupSpec,
    block_size: int,
    dtype: torch.dtype,
    tp_size: int = 1,
    layer_ids: range | None = None,
) -> int:
    """Bytes of one block of a group: keys and values of each of its layers (this rank's heads,
    of `layer_ids` only when given); for the recurrent group, one state slot of each."""
    num_layers = sum(1 for i in group.layer_ids if layer_ids is None or i in layer_ids)
    if group.recurrent:
        return num_layers * _recurrent_slot_bytes(model_config.arch, dtype)
    element_size = torch.empty((), dtype=dtype).element_size()
    num_kv_heads = kv_heads_per_rank(model_config.num_kv_heads, tp_size)
    per_layer = 2 * block_size * num_kv_heads * model_config.head_dim * element_size
    return num_layers * per_layer


def kv_bytes_per_block(
    model_config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    tp_size: int = 1,
    layer_ids: range | None = None,
) -> int:
    """Bytes of one block in every layer (of `layer_ids` when given): one block of each group."""
    return sum(
        group_bytes_per_block(model_config, group, block_size, dtype, tp_size, layer_ids)
        for group in kv_cache_group_specs(model_config)
    )


def blocks_per_sequence(
    group: KVCacheGroupSpec, scheduler_config: SchedulerConfig, block_size: int
) -> int:
    """The most blocks of a group one sequence of max_model_len holds at once."""
    return group.max_blocks_per_request(
        scheduler_config.max_model_len, scheduler_config.max_num_batched_tokens, block_size
    )


def blocks_worth_keeping(
    scheduler_config: SchedulerConfig, block_size: int, group: KVCacheGroupSpec | None = None
) -> int:
    """Enough blocks for every sequence slot at full length (+ the padding block): more is waste.
    `group` defaults to full attention."""
    group = group or KVCacheGroupSpec(())
    return (
        scheduler_config.max_num_seqs * blocks_per_sequence(group, scheduler_config, block_size) + 1
    )


def num_blocks_from_budget(
    budget_bytes: int,
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    dtype: torch.dtype,
    cap_to_need: bool = False,
    tp_size: int = 1,
    layer_ids: range | None = None,
) -> list[int]:
    """Blocks per layer group that fit in `budget_bytes` (at most what every sequence slot at full
    length needs, with `cap_to_need`); fails with the numbers to change if one sequence can't fit.
    With `layer_ids` (a pipeline stage), the caches of those layers only."""
    block_size = cache_config.block_size
    groups = kv_cache_group_specs(model_config)
    sizes = [
        group_bytes_per_block(model_config, g, block_size, dtype, tp_size, layer_ids)
        for g in groups
    ]
    needs = [blocks_per_sequence(g, scheduler_config, block_size) for g in groups]
    # With prefix caching, as many slots again for snapshots.
    wanted = (2 if cache_config.enable_prefix_caching else 1) * scheduler_config.max_num_seqs + 1
    slots = {
        g: min(wanted, budget_bytes // 2 // size)
        for g, (group, size) in enumerate(zip(groups, sizes))
        if group.recurrent
    }
    attention_budget = budget_bytes - sum(n * sizes[g] for g, n in slots.items())
    per_sequence = sum(
        need * size for g, (need, size) in enumerate(zip(needs, sizes)) if g not in slots
    )
    num_attention_groups = len(groups) - len(slots)
    counts = []
    for g, (group, size, need) in enumerate(zip(groups, sizes, needs)):
        # An attention group's share of the rest is need * size / per_sequence of it.
        if size == 0:  # none of its layers here
            counts.append(
                blocks_worth_keeping(scheduler_config, block_size, group)
                if cap_to_need
                else UNBOUNDED_BLOCKS
            )
            continue
        if g in slots:
            num_blocks = slots[g]
        elif num_attention_groups > 1:
            num_blocks = attention_budget * need // per_sequence
        else:
            num_blocks = attention_budget // size
        if cap_to_need and g not in slots:  # slots are capped by `wanted` already
            num_blocks = min(num_blocks, blocks_worth_keeping(scheduler_config, block_size, group))
        if num_blocks < need + 1:
            which = "" if len(groups) == 1 else f" in its {len(group.layer_ids)}-layer group"
            raise ValueError(
                f"the KV cache budget of {budget_bytes / _GIB:.2f} GiB holds {num_blocks} blocks "
                f"of {block_size} tokens{which}, but one sequence of max_model_len="
                f"{scheduler_config.max_model_len} needs {need + 1} "
                f"({(need + 1) * size / _GIB:.2f} GiB): lower max_model_len, or raise "
                "gpu_memory_utilization / kv_cache_memory_bytes"
            )
        counts.append(int(num_blocks))
    return counts


def cpu_kv_budget(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    dtype: torch.dtype,
    tp_size: int = 1,
    layer_ids: range | None = None,
) -> int:
    """kv_cache_memory_bytes when set; else what every sequence slot at full length needs (in the
    layers `layer_ids`, when given), at most CPU_DEFAULT_KV_BYTES but at least one sequence of
    max_model_len."""
    if cache_config.kv_cache_memory_bytes is not None:
        return cache_config.kv_cache_memory_bytes
    block_size = cache_config.block_size
    one_sequence = every_slot = 0
    for group in kv_cache_group_specs(model_config):
        size = group_bytes_per_block(model_config, group, block_size, dtype, tp_size, layer_ids)
        one_sequence += (blocks_per_sequence(group, scheduler_config, block_size) + 1) * size
        every_slot += blocks_worth_keeping(scheduler_config, block_size, group) * size
    return max(min(every_slot, CPU_DEFAULT_KV_BYTES), one_sequence)


def allocate_kv_caches(
    model_config: ModelConfig,
    num_blocks: int | list[int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int = 1,
    layer_ids: range | None = None,
) -> list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """One zeroed cache per layer (of `layer_ids` when given, in order), sized by its group's
    pool (`num_blocks` per group, or one count for all); a linear-attention layer's is its
    (conv state, recurrent state) pools."""
    groups = kv_cache_group_specs(model_config)
    counts = [num_blocks] * len(groups) if isinstance(num_blocks, int) else num_blocks
    heads = kv_heads_per_rank(model_config.num_kv_heads, tp_size)
    head_dim = model_config.head_dim
    conv_shape, state_shape = recurrent_state_shapes(model_config.arch)
    caches: list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = []
    for layer, g in enumerate(layer_group_ids(groups)):
        if layer_ids is not None and layer not in layer_ids:
            continue
        if groups[g].recurrent:
            conv = torch.zeros((counts[g], *conv_shape), dtype=dtype, device=device)
            state = torch.zeros(
                (counts[g], *state_shape), dtype=RECURRENT_STATE_DTYPE, device=device
            )
            caches.append((conv, state))
        else:
            shape = (2, counts[g], block_size, heads, head_dim)
            caches.append(torch.zeros(shape, dtype=dtype, device=device))
    return caches
