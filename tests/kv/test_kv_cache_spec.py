from __future__ import annotations

import pytest

from ferrum.kv.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups, layer_group_ids


def test_groups_put_full_attention_first_then_each_window() -> None:
    # Gemma 3's pattern: five sliding layers, then a global one.
    windows = [512, 512, 512, 512, 512, None, 512, 128]
    groups = kv_cache_groups(windows)
    assert groups == (
        KVCacheGroupSpec((5,), None),
        KVCacheGroupSpec((7,), 128),
        KVCacheGroupSpec((0, 1, 2, 3, 4, 6), 512),
    )
    assert layer_group_ids(groups) == [2, 2, 2, 2, 2, 0, 2, 1]
    assert kv_cache_groups([None, None]) == (KVCacheGroupSpec((0, 1)),)
    with pytest.raises(ValueError, match="layer_windows"):
        kv_cache_groups([])


def test_blocks_a_request_holds_at_most() -> None:
    full, window = KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), 6)
    assert full.max_blocks_per_request(100, 8, 4) == 25
    # The 5 keys before a chunk of 8, the chunk, and one partial block: ceil(13 / 4) + 1.
    assert window.max_blocks_per_request(100, 8, 4) == 5
    assert window.max_blocks_per_request(10, 8, 4) == 3  # never more than the request itself
