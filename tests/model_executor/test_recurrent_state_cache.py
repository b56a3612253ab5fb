"""The linear-attention state slots: zeroed for a fresh request, filled from a prefix hit's
snapshot, copied into a snapshot slot after a chunk that ends on one; a no-op without them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ferrum.kv.kv_cache_spec import KVCacheGroupSpec
from ferrum.model_executor.recurrent_state_cache import RecurrentStateCache

BLOCK = 4
GROUPS = (KVCacheGroupSpec((0,)), KVCacheGroupSpec((1,), recurrent=True))


def pools() -> list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """Layer 0's KV cache, layer 1's (conv, recurrent) pools: slot s holds s + 1 everywhere."""
    fill = torch.arange(1.0, 9.0)
    return [torch.zeros(2, 8, BLOCK, 1, 1), (fill.view(8, 1).repeat(1, 3), fill.view(8, 1, 1))]


def new_request(num_computed: int, table: list[int]) -> SimpleNamespace:
    return SimpleNamespace(block_ids=([1, 2, 3], table), num_computed_tokens=num_computed)


def test_fresh_requests_start_from_zeroed_slots_and_hits_from_their_snapshot() -> None:
    caches = pools()
    cache = RecurrentStateCache(GROUPS, BLOCK, torch.device("cpu"))
    cache.bind(caches)
    # Fresh on slot 2; a hit of 8 tokens on slot 3 whose snapshot after block 2 sits in slot 6.
    cache.start_requests([new_request(0, [2, 0]), new_request(8, [3, 6])])
    conv, state = caches[1]
    assert conv[:, 0].tolist() == [1, 2, 0, 7, 5, 6, 7, 8]
    assert state.flatten().tolist() == [1, 2, 0, 7, 5, 6, 7, 8]
    assert not caches[0].any()  # the attention cache is not a state pool


def test_a_chunk_ending_on_a_snapshot_block_copies_its_live_state_there() -> None:
    caches = pools()
    cache = RecurrentStateCache(GROUPS, BLOCK, torch.device("cpu"))
    cache.bind(caches)
    requests = {
        "ends": SimpleNamespace(num_computed_tokens=4, block_ids=([1, 2], [2, 5])),
        "short": SimpleNamespace(num_computed_tokens=0, block_ids=([3], [3, 7])),
        "unmarked": SimpleNamespace(num_computed_tokens=0, block_ids=([4, 5], [4, 0])),
    }
    # "ends" computes [4, 8): block 1 ends there and its entry holds slot 5; "short" ends
    # mid-block; "unmarked" ends on block 1, which holds no snapshot slot.
    cache.snapshot(requests, {"ends": 4, "short": 3, "unmarked": 8})
    assert caches[1][1].flatten().tolist() == [1, 2, 3, 4, 5, 3, 7, 8]


def test_without_linear_attention_nothing_is_touched() -> None:
    cache = RecurrentStateCache(GROUPS[:1], BLOCK, torch.device("cpu"))
    cache.bind([torch.ones(2, 4, BLOCK, 1, 1)])
    assert cache.groups == []
    cache.start_requests([SimpleNamespace(block_ids=([1],), num_computed_tokens=0)])
    cache.snapshot({}, {"absent": 4})  # returns before reading any request
