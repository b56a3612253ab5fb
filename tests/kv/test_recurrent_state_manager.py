"""State slots of linear-attention layers: one slot per request heading a table of null entries
as long as the attention groups' tables; a hybrid KV cache turns prefix caching off."""

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
    return Request(req_id, list(range(num_tokens)), SamplingParams(max_tokens=64))


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


def test_hybrid_cache_turns_prefix_caching_off_and_allocates_in_every_group() -> None:
    manager = KVCacheManager([8, 3], BS, enable_prefix_caching=True, groups=HYBRID_GROUPS)
    assert not manager.enable_prefix_caching
    r1 = make_request("r1", 9)
    assert manager.allocate_slots(r1, 9) == ([1, 2, 3], [1, 0, 0])
    r1.num_computed_tokens = 9
    manager.free(r1)
    # The same prompt again: no hit, though its attention blocks were full.
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
    assert manager.usage > 0.0
