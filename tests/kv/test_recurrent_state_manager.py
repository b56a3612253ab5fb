"""State slots of linear-attention layers: one live slot per request heading a table as long as
the attention groups' tables, snapshots at block boundaries for the prefix cache, and hybrid
hits that every group can serve."""

from __future__ import annotations

import pytest

from ferrum.kv.kv_cache_manager import KVCacheManager
from ferrum.kv.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups, layer_group_ids
from ferrum.kv.recurrent_state_manager import RecurrentStateManager
from ferrum.request import Request
from ferrum.sampling_params import SamplingParams

BS = 4
# Qwen3.5-like: layers 0, 1 and 3 linear, layer 2 full attention.
HYBRID_GROUPS = kv_cache_groups([None] * 4, recurrent_layers=(0, 1, 3))


def make_request(req_id: str, num_tokens: int) -> Request:
    return Request(req_id, list(range(num_tokens)), SamplingParams(max_tokens=64).resolve())


def test_recurrent_layers_form_the_last_group() -> None:
    full, recurrent = HYBRID_GROUPS
    assert full == KVCacheGroupSpec((2,))
    assert recurrent == KVCacheGroupSpec((0, 1, 3), recurrent=True)
    assert layer_group_ids(HYBRID_GROUPS) == [1, 1, 0, 1]
    assert HYBRID_GROUPS[1].max_blocks_per_request(1000, 64, BS) == 1
    with pytest.raises(ValueError, match="at least one attention layer"):
        kv_cache_groups([None, None], recurrent_layers=(0, 1))


def test_one_slot_per_request_then_null_entries() -> None:
    manager = RecurrentStateManager(num_slots=3, block_size=BS)
    r1, r2, r3 = make_request("r1", 9), make_request("r2", 2), make_request("r3", 5)
    assert manager.allocate_slots(r1, 5) == [1, 0]
    r1.num_computed_tokens = 5
    assert manager.covers(r1, 3) and not manager.covers(r1, 4)
    assert manager.allocate_slots(r1, 4) == [0]
    assert manager.get_block_ids("r1") == [1, 0, 0]
    assert manager.allocate_slots(r2, 2) == [2]
    assert manager.allocate_slots(r3, 5) is None  # both usable slots are held
    assert manager.usage == 1.0
    manager.free(r1)
    assert manager.allocate_slots(r3, 5) == [1, 0]
    manager.free(r2)
    manager.free(r3)
    manager.free(r3)  # unknown ids are a no-op
    assert manager.usage == 0.0
    assert manager.get_computed_blocks(r1) == ([], 0)


def test_hybrid_cache_without_prefix_caching_allocates_in_every_group() -> None:
    manager = KVCacheManager([8, 3], BS, enable_prefix_caching=False, groups=HYBRID_GROUPS)
    r1 = make_request("r1", 9)
    assert manager.allocate_slots(r1, 9) == ([1, 2, 3], [1, 0, 0])
    r1.num_computed_tokens = 9
    manager.free(r1)
    r2 = make_request("r2", 9)
    assert manager.get_computed_blocks(r2) == (([], []), 0)
    assert manager.allocate_slots(r2, 9) is not None
    # Blocks left for a second request, but no state slot: nothing is allocated.
    r3 = make_request("r3", 1)
    assert manager.allocate_slots(make_request("r4", 1), 1) is not None
    assert manager.groups[0].num_free_blocks == 3
    assert manager.allocate_slots(r3, 1) is None
    assert manager.get_block_ids("r3") == ([], [])
    assert manager.groups[0].num_free_blocks == 3


def snapshot_manager(num_slots: int = 6) -> RecurrentStateManager:
    return RecurrentStateManager(
        num_slots, BS, enable_prefix_caching=True, snapshot_interval_blocks=2
    )


def test_a_chunk_ending_on_a_boundary_takes_a_snapshot_cached_at_the_next_step() -> None:
    manager = snapshot_manager()
    r1 = make_request("r1", 19)
    manager.begin_step()
    # Chunks end on the last snapshot boundary inside them (every 2 blocks = 8 tokens).
    assert manager.chunk_end(r1, 0, 19) == 16
    assert manager.chunk_end(r1, 0, 7) == 7
    assert manager.allocate_slots(r1, 16) == [1, 0, 0, 2]  # live slot, snapshot after block 3
    r1.num_computed_tokens = 16
    # Not hittable before its step ran: cached at the next begin_step.
    r2 = make_request("r2", 19)
    assert manager.get_computed_blocks(r2) == ([], 0)
    manager.end_step()
    manager.begin_step()
    assert manager.get_computed_blocks(r2) == ([0, 0, 0, 2], 16)
    # r1's next allocation releases the snapshot (still cached); a chunk inside a block keeps
    # none (it does not cover the boundary's whole block).
    assert manager.chunk_end(r1, 16, 19) == 19
    assert manager.allocate_slots(r1, 3) == [0]
    assert manager.block_pool.ref_count(2) == 0
    # r2 hits: a fresh live slot, the snapshot held until its next allocation.
    hit, num_computed = manager.get_computed_blocks(r2)
    assert manager.allocate_slots(r2, 3, hit) == [3, 0, 0, 2, 0]
    assert manager.block_pool.ref_count(2) == 1
    r2.num_computed_tokens = 19
    assert manager.allocate_slots(r2, 1) == []
    assert manager.block_pool.ref_count(2) == 0
    manager.free(r1)
    manager.free(r2)
    assert manager.usage == 0.0


def test_a_failed_step_uncaches_its_snapshots() -> None:
    manager = snapshot_manager()
    r1 = make_request("r1", 12)
    manager.begin_step()
    assert manager.allocate_slots(r1, 8) == [1, 2]
    r1.num_computed_tokens = 8
    manager.begin_step()  # async: the next pass begins before the first step ended
    assert manager.get_computed_blocks(make_request("r2", 12)) == ([0, 2], 8)
    manager.discard_step_cache()
    assert manager.get_computed_blocks(make_request("r2", 12)) == ([], 0)


def test_hybrid_hits_land_where_every_group_has_what_it_needs() -> None:
    manager = KVCacheManager(
        [16, 6], BS, groups=HYBRID_GROUPS, max_num_batched_tokens=64, snapshot_interval_blocks=2
    )
    r1 = make_request("r1", 14)
    manager.begin_step()
    assert manager.chunk_end(r1, 0, 14) == 8
    assert manager.allocate_slots(r1, 8) == ([1, 2], [1, 2])
    r1.num_computed_tokens = 8
    manager.begin_step()
    assert manager.allocate_slots(r1, 6) == ([3, 4], [0, 0])
    r1.num_computed_tokens = 14
    # Attention caches 3 full blocks, the state group a snapshot after 2: the hit is 2 blocks.
    r2 = make_request("r2", 14)
    assert manager.get_computed_blocks(r2) == (([1, 2], [0, 2]), 8)
