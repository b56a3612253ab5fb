"""The KV cache of every layer group behind one API: block ids per group, allocations that
happen in every group or in none, and prefix hits that every group can serve."""

from __future__ import annotations

import pytest

from ferrum.kv.kv_cache_manager import KVCacheManager
from ferrum.kv.kv_cache_spec import KVCacheGroupSpec
from ferrum.request import Request
from ferrum.sampling_params import SamplingParams

BS = 4
# Gemma-like: a global layer and a sliding one (window 6: position p reads keys p - 5 .. p).
GROUPS = (KVCacheGroupSpec((1,)), KVCacheGroupSpec((0,), 6))


def make_request(req_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(req_id, prompt_token_ids, SamplingParams(max_tokens=64).resolve())


def hybrid(num_blocks: list[int]) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, groups=GROUPS, max_num_batched_tokens=4)


def compute_in_chunks(manager: KVCacheManager, request: Request, chunk: int) -> None:
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, n) is not None
        request.num_computed_tokens += n


def test_one_group_is_todays_manager() -> None:
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    r1 = make_request("r1", list(range(9)))
    assert manager.allocate_slots(r1, 9) == ([1, 2, 3],)
    r1.num_computed_tokens = 9
    assert manager.get_block_ids("r1") == ([1, 2, 3],)
    r2 = make_request("r2", list(range(8)) + [100, 101])
    computed, num_cached = manager.get_computed_blocks(r2)
    assert (computed, num_cached) == (([1, 2],), 8)
    assert manager.allocate_slots(r2, 2, computed) == ([1, 2, 4],)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (10, 8)
    assert manager.usage == pytest.approx(4 / 9)
    assert manager.max_tokens_in_pool() == 36
    assert not manager.reset_prefix_cache()
    manager.free(r1)
    manager.free(r2)
    assert manager.usage == 0.0 and manager.reset_prefix_cache()


def test_groups_grow_together_and_the_window_group_releases_blocks() -> None:
    manager = hybrid([12, 6])
    r1 = make_request("r1", list(range(17)))
    compute_in_chunks(manager, r1, 4)
    assert manager.get_block_ids("r1") == ([1, 2, 3, 4, 5], [0, 0, 3, 4, 5])
    assert manager.num_usable_blocks == 16 and manager.num_free_blocks == 6 + 2
    assert manager.max_tokens_in_pool() == 44  # the full group's 11 blocks


def test_an_allocation_short_in_one_group_changes_no_group() -> None:
    manager = hybrid([12, 4])  # 3 usable sliding blocks
    r1 = make_request("r1", list(range(8)))
    assert manager.allocate_slots(r1, 8) == ([1, 2], [1, 2])
    r1.num_computed_tokens = 8
    r2 = make_request("r2", list(range(100, 108)))
    assert manager.allocate_slots(r2, 8) is None
    assert manager.get_block_ids("r2") == ([], [])
    assert manager.groups[0].num_free_blocks == 9


def test_a_hit_is_the_longest_prefix_every_group_serves() -> None:
    manager = hybrid([12, 9])
    prompt = list(range(17))
    r1 = make_request("r1", prompt)
    compute_in_chunks(manager, r1, 4)
    manager.free(r1)
    computed, num_cached = manager.get_computed_blocks(make_request("a", prompt))
    assert (computed, num_cached) == (([1, 2, 3, 4], [0, 0, 3, 4]), 16)
    # The window group loses block 4 (tokens 12-15): position 16's window is gone; the
    # full group still holds every block, so the hit falls back to 12 tokens (window 7..11).
    manager.groups[1].block_pool.uncache(4)
    r2 = make_request("r2", prompt)
    computed, num_cached = manager.get_computed_blocks(r2)
    assert (computed, num_cached) == (([1, 2, 3], [0, 2, 3]), 12)
    assert manager.allocate_slots(r2, 5, computed) == ([1, 2, 3, 5, 6], [0, 2, 3, 5, 6])
    # The full group loses its first block: nothing is served.
    manager.groups[0].block_pool.uncache(1)
    assert manager.get_computed_blocks(make_request("b", prompt)) == (([], []), 0)


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_blocks: expected one pool size per layer group"):
        KVCacheManager([4], BS, groups=GROUPS, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_num_batched_tokens: needed"):
        KVCacheManager(4, BS, groups=GROUPS)
    manager = hybrid([8, 8])
    with pytest.raises(ValueError, match="new_computed_blocks: every layer group"):
        manager.allocate_slots(make_request("r", list(range(9))), 1, ([1], []))
