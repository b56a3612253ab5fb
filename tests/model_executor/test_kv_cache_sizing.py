"""KV cache sizing: bytes per block, blocks from a byte budget (capped, or refused with the numbers
to change), the CPU default budget, and the per-layer cache tensors. The tiny qwen3 checkpoint
has 2 layers, 2 KV heads of head_dim 16: 2 * 2 * 2 * 16 = 128 elements per token."""

from __future__ import annotations

import pytest
import torch

from ferrum.config import CacheConfig, ModelConfig, SchedulerConfig
from ferrum.model_executor.kv_cache_sizing import (
    CPU_DEFAULT_KV_BYTES,
    allocate_kv_caches,
    blocks_worth_keeping,
    cpu_kv_budget,
    kv_bytes_per_block,
    kv_cache_group_specs,
    num_blocks_from_budget,
)
from tests.utils.tiny_llm import make_llm

FP32_BLOCK_OF_4 = 128 * 4 * 4  # elements per token * tokens per block * bytes per element


@pytest.fixture
def model_config(tiny_checkpoint) -> ModelConfig:
    return ModelConfig(tiny_checkpoint("qwen3"))


def test_bytes_per_block_count_keys_and_values_of_every_layer(model_config) -> None:
    assert kv_bytes_per_block(model_config, 4, torch.float32) == FP32_BLOCK_OF_4 == 2048
    assert kv_bytes_per_block(model_config, 4, torch.bfloat16) == 1024
    assert kv_bytes_per_block(model_config, 16, torch.float16) == 4096


def test_a_tensor_parallel_rank_holds_its_kv_heads(model_config) -> None:
    # 2 KV heads: one per rank at tp 2, one replicated on every rank at tp 4.
    for tp in (2, 4):
        assert kv_bytes_per_block(model_config, 4, torch.float32, tp) == FP32_BLOCK_OF_4 // 2
        caches = allocate_kv_caches(model_config, 5, 4, torch.float32, torch.device("cpu"), tp)
        assert caches[0].shape == (2, 5, 4, 1, 16)


def test_blocks_worth_keeping_cover_every_sequence_slot_at_full_length() -> None:
    # ceil(100 / 16) = 7 blocks per sequence, 3 sequences, + the padding block.
    assert blocks_worth_keeping(SchedulerConfig(max_model_len=100, max_num_seqs=3), 16) == 22
    assert blocks_worth_keeping(SchedulerConfig(max_model_len=96, max_num_seqs=1), 16) == 7


def test_blocks_from_budget_round_down_and_cap_to_need(model_config) -> None:
    cache = CacheConfig(block_size=4)
    sched = SchedulerConfig(max_model_len=128, max_num_seqs=2)

    def blocks(budget: int, cap: bool = False) -> int:
        (count,) = num_blocks_from_budget(budget, model_config, cache, sched, torch.float32, cap)
        return count

    assert blocks(100 * FP32_BLOCK_OF_4 + FP32_BLOCK_OF_4 - 1) == 100
    # Two sequences of 32 blocks + the padding block: more would never be used.
    assert blocks(100 * FP32_BLOCK_OF_4, cap=True) == 65
    assert blocks(40 * FP32_BLOCK_OF_4, cap=True) == 40
    assert isinstance(blocks(10**9), int)


def test_a_budget_short_of_one_full_length_sequence_is_refused(model_config) -> None:
    cache = CacheConfig(block_size=4)
    sched = SchedulerConfig(max_model_len=128)
    # One sequence of 128 tokens needs 32 blocks + the padding block.
    assert num_blocks_from_budget(33 * 2048, model_config, cache, sched, torch.float32) == [33]
    message = (
        r"holds 32 blocks of 4 tokens, but one sequence of max_model_len=128 needs 33 .*lower "
        r"max_model_len, or raise gpu_memory_utilization / kv_cache_memory_bytes"
    )
    with pytest.raises(ValueError, match=message):
        num_blocks_from_budget(33 * 2048 - 1, model_config, cache, sched, torch.float32)


def test_cpu_budget_defaults_to_what_the_sequence_slots_need_bounded(model_config) -> None:
    def budget(cache: CacheConfig, max_model_len: int, max_num_seqs: int) -> int:
        sched = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs)
        return cpu_kv_budget(model_config, cache, sched, torch.float32)

    cache = CacheConfig(block_size=4)
    assert budget(CacheConfig(kv_cache_memory_bytes=12345), 128, 2) == 12345
    # Two sequences of 32 blocks + the padding block.
    assert budget(cache, 128, 2) == 65 * FP32_BLOCK_OF_4
    assert budget(cache, 128, 100_000) == CPU_DEFAULT_KV_BYTES == 512 << 20
    # Never less than one sequence of max_model_len (2**18 blocks + the padding block).
    assert budget(cache, 2**20, 1) == (2**18 + 1) * FP32_BLOCK_OF_4 > CPU_DEFAULT_KV_BYTES


def test_allocated_caches_are_one_zeroed_tensor_per_layer(model_config) -> None:
    caches = allocate_kv_caches(model_config, 5, 4, torch.float16, torch.device("cpu"))
    assert len(caches) == 2
    assert caches[0].data_ptr() != caches[1].data_ptr()
    for cache in caches:
        assert cache.shape == (2, 5, 4, 2, 16) and cache.dtype == torch.float16
        assert not cache.any()


def test_layer_groups_split_the_budget_by_what_a_sequence_holds(tiny_checkpoint) -> None:
    # gemma3: layers sliding (window 6), global, sliding; 1024 bytes per layer per fp32 block.
    config = ModelConfig(tiny_checkpoint("gemma3"))
    assert [g.layer_ids for g in kv_cache_group_specs(config)] == [(1,), (0, 2)]
    assert kv_bytes_per_block(config, 4, torch.float32) == 3 * 1024
    cache = CacheConfig(block_size=4)
    sched = SchedulerConfig(max_model_len=128, max_num_batched_tokens=8, max_num_seqs=2)
    # A sequence holds 32 global blocks and ceil((5 + 8) / 4) + 1 = 5 sliding ones: 43008 bytes.
    per_sequence = 32 * 1024 + 5 * 2048
    assert num_blocks_from_budget(10 * per_sequence, config, cache, sched, torch.float32) == [
        320,
        50,
    ]
    capped = num_blocks_from_budget(10 * per_sequence, config, cache, sched, torch.float32, True)
    assert capped == [65, 11]
    assert cpu_kv_budget(config, cache, sched, torch.float32) == 65 * 1024 + 11 * 2048
    with pytest.raises(
        ValueError, match="holds 32 blocks of 4 tokens in its 1-layer group, .* needs 33"
    ):
        num_blocks_from_budget(per_sequence, config, cache, sched, torch.float32)
    caches = allocate_kv_caches(config, [7, 3], 4, torch.float32, torch.device("cpu"))
    assert [c.shape[1] for c in caches] == [3, 7, 3]


def test_the_cpu_engine_sizes_its_pool_from_the_budget(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    # The default budget: 2 sequences of 32 blocks + the padding block.
    llm = make_llm(path, max_num_seqs=2)
    assert llm.llm_engine.core.kv_cache_manager.num_usable_blocks == 64
    llm = make_llm(path, kv_cache_memory_bytes=50 * FP32_BLOCK_OF_4)
    assert llm.llm_engine.core.kv_cache_manager.num_usable_blocks == 49


def test_num_cpu_threads_sets_torchs_threads(tiny_checkpoint) -> None:
    before = torch.get_num_threads()
    try:
        make_llm(tiny_checkpoint("qwen3"), num_cpu_threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="num_cpu_threads: must be an integer >= 1, got 0"):
        make_llm(tiny_checkpoint("qwen3"), num_cpu_threads=0)


def test_recurrent_layers_take_a_state_slot_per_sequence_first(tiny_checkpoint) -> None:
    # qwen3_5: layers linear, linear, full, linear. A linear layer's fp32 slot: conv state
    # 3 x 128 + recurrent state 4 heads x 16 x 16 = 5632 bytes; 1024 bytes per attention block.
    config = ModelConfig(tiny_checkpoint("qwen3_5"))
    full, recurrent = kv_cache_group_specs(config)
    assert (full.layer_ids, recurrent.layer_ids, recurrent.recurrent) == ((2,), (0, 1, 3), True)
    assert kv_bytes_per_block(config, 4, torch.float32) == 1024 + 3 * 5632
    cache = CacheConfig(block_size=4)
    sched = SchedulerConfig(max_model_len=128, max_num_batched_tokens=8, max_num_seqs=2)
    # max_num_seqs + 1 slots (and max_num_seqs more for snapshots with prefix caching), the
    # rest in attention blocks.
    budget = 200_000
    assert num_blocks_from_budget(budget, config, cache, sched, torch.float32) == [
        (budget - 5 * 16896) // 1024,
        5,
    ]
    no_caching = CacheConfig(block_size=4, enable_prefix_caching=False)
    assert num_blocks_from_budget(budget, config, no_caching, sched, torch.float32) == [
        (budget - 3 * 16896) // 1024,
        3,
    ]
    # At most half the budget goes to slots: one slot (+ padding) is too few.
    with pytest.raises(ValueError, match="holds 1 blocks of 4 tokens in its 3-layer group"):
        num_blocks_from_budget(60_000, config, cache, sched, torch.float32)
    caches = allocate_kv_caches(config, [7, 3], 4, torch.float32, torch.device("cpu"))
    conv, state = caches[0]
    assert conv.shape == (3, 3, 128) and state.shape == (3, 4, 16, 16)
    assert state.dtype == torch.float32 and caches[2].shape == (2, 7, 4, 2, 16)
