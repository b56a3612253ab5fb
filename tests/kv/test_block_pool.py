from __future__ import annotations

import pytest

from ferrum.kv.block_pool import ROOT_ENTRY_ID, BlockPool


def test_fresh_pool_allocates_in_increasing_order_and_never_block_zero() -> None:
    pool = BlockPool(6)
    assert pool.num_usable_blocks == 5
    assert pool.free_block_ids == [1, 2, 3, 4, 5]
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) == [3, 4, 5]
    assert [pool.ref_count(b) for b in range(6)] == [0, 1, 1, 1, 1, 1]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="num_blocks=1 exceeds the 0 free blocks"):
        pool.allocate(1)


def test_free_puts_cached_blocks_at_the_back_and_uncached_at_the_front() -> None:
    pool = BlockPool(6)
    cached, plain, _ = pool.allocate(1)[0], pool.allocate(1)[0], pool.allocate(1)[0]
    pool.cache_block(cached, 111, ROOT_ENTRY_ID, [1, 2])
    assert pool.free_block_ids == [4, 5]
    pool.free([cached])
    assert pool.free_block_ids == [4, 5, 1]
    pool.free([plain])
    assert pool.free_block_ids == [2, 4, 5, 1]
    # Eviction follows the queue; evicting a cached block drops its entry.
    assert pool.allocate(4) == [2, 4, 5, 1]
    assert pool.entry(1) is None
    assert pool.lookup(111, ROOT_ENTRY_ID, [1, 2]) is None
    assert pool.num_cached_blocks == 0


def test_touch_takes_free_blocks_out_of_the_queue() -> None:
    pool = BlockPool(5)
    block_id = pool.allocate(1)[0]
    pool.cache_block(block_id, 7, ROOT_ENTRY_ID, [3])
    pool.free([block_id])
    assert pool.free_block_ids == [2, 3, 4, 1]
    pool.touch([block_id])
    pool.touch([block_id])
    assert pool.ref_count(block_id) == 2
    assert pool.free_block_ids == [2, 3, 4]
    pool.free([block_id])
    assert pool.free_block_ids == [2, 3, 4]
    pool.free([block_id])
    assert pool.free_block_ids == [2, 3, 4, 1]
    assert pool.lookup(7, ROOT_ENTRY_ID, [3]) == block_id


def test_lookup_verifies_tokens_and_parent() -> None:
    pool = BlockPool(4)
    first, second = pool.allocate(2)
    first_entry = pool.cache_block(first, 10, ROOT_ENTRY_ID, [1, 2])
    pool.cache_block(second, 20, first_entry, [3, 4])
    assert pool.lookup(10, ROOT_ENTRY_ID, [1, 2]) == first
    assert pool.lookup(20, first_entry, (3, 4)) == second
    assert pool.lookup(10, ROOT_ENTRY_ID, [1, 9]) is None
    assert pool.lookup(20, ROOT_ENTRY_ID, [3, 4]) is None
    assert pool.lookup(30, first_entry, [3, 4]) is None
    # find: whatever the parent (a sliding window's first block), the tokens still count.
    assert pool.find(20, [3, 4]) == second
    assert pool.find(20, [3, 5]) is None and pool.find(30, [3, 4]) is None


def test_same_content_registers_once_and_collisions_get_a_fresh_entry() -> None:
    pool = BlockPool(5)
    a, b, c = pool.allocate(3)
    entry_a = pool.cache_block(a, 10, ROOT_ENTRY_ID, [1, 2])
    # Same content: b shares a's entry id but stays unregistered.
    assert pool.cache_block(b, 10, ROOT_ENTRY_ID, [1, 2]) == entry_a
    assert pool.entry(b) is None
    # Same hash, other tokens: a fresh entry id that no cached block holds.
    entry_c = pool.cache_block(c, 10, ROOT_ENTRY_ID, [5, 6])
    assert entry_c not in (ROOT_ENTRY_ID, entry_a)
    assert pool.entry(c) is None
    assert pool.lookup(10, ROOT_ENTRY_ID, [1, 2]) == a
    assert pool.lookup(10, ROOT_ENTRY_ID, [5, 6]) is None
    pool.free([c, b, a])
    assert pool.free_block_ids == [b, c, 4, a]


def test_reset_prefix_cache_only_when_nothing_is_in_use() -> None:
    pool = BlockPool(5)
    a, b = pool.allocate(2)
    pool.cache_block(a, 10, ROOT_ENTRY_ID, [1])
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(10, ROOT_ENTRY_ID, [1]) == a
    pool.free([b, a])
    assert pool.free_block_ids == [2, 3, 4, 1]
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(10, ROOT_ENTRY_ID, [1]) is None
    assert pool.num_cached_blocks == 0
    assert pool.free_block_ids == [1, 2, 3, 4]


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 2"):
        BlockPool(1)
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="block 1 is already free"):
        pool.free([1])
    with pytest.raises(ValueError, match="null block"):
        pool.touch([0])
    with pytest.raises(ValueError, match="must be in use"):
        pool.cache_block(1, 5, ROOT_ENTRY_ID, [1])
    block_id = pool.allocate(1)[0]
    pool.cache_block(block_id, 5, ROOT_ENTRY_ID, [1])
    with pytest.raises(ValueError, match="not yet cached"):
        pool.cache_block(block_id, 6, ROOT_ENTRY_ID, [2])
