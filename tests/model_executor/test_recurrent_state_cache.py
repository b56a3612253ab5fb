"""The linear-attention state slots: zeroed for a fresh request, filled from a prefix hit's
snapshot, copied into a snapshot slot after a chunk that ends on one (never after a chunk with
drafts); after a verify step, the scratch slot of each request's last accepted token copied into
its live slot; a no-op without them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ferrum.kv.kv_cache_spec import KVCacheGroupSpec
from ferrum.model_executor.recurrent_state_cache import RecurrentStateCache
from ferrum.model_executor.verify_states import VerifyStateLayout

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
        "verifying": SimpleNamespace(num_computed_tokens=5, block_ids=([6, 7], [1, 6])),
    }
    # "ends" computes [4, 8): block 1 ends there and its entry holds slot 5; "short" ends
    # mid-block; "unmarked" ends on block 1, which holds no snapshot slot; "verifying" ends on
    # block 1 too, but with drafts.
    num_scheduled = {"ends": 4, "short": 3, "unmarked": 8, "verifying": 3}
    cache.snapshot(requests, num_scheduled, {"verifying": [9, 9]})
    assert caches[1][1].flatten().tolist() == [1, 2, 3, 4, 5, 3, 7, 8]


def test_a_rejected_draft_rolls_the_live_state_back_to_the_last_accepted_token() -> None:
    """Scratch slots from 5, two per verifying request (k = 2): "all" accepted both drafts,
    "one" accepted one (its state after token 1: scratch slot 5 + 2 + 1), "none" none (its
    state after token 0: slot 5 + 4 + 0), "gone" was aborted meanwhile, "plain" had none."""
    fill = torch.arange(1.0, 14.0)  # slot s holds s + 1: 5 live slots, then 4 rows of 2
    caches = [torch.zeros(2, 8, BLOCK, 1, 1), (fill.view(13, 1).repeat(1, 3), fill.view(13, 1, 1))]
    cache = RecurrentStateCache(GROUPS, BLOCK, torch.device("cpu"))
    cache.bind(caches)
    layout = VerifyStateLayout(recurrent_group=1, num_speculative_tokens=2, scratch_base=5)
    tables = {"all": [1], "plain": [2], "one": [3], "none": [4], "gone": [0]}
    states = [SimpleNamespace(block_ids=([9], t)) for t in tables.values()]
    drafts = [[7, 7], [], [7, 7], [7, 7], [7, 7]]
    emitted = [[7, 7, 1], [1], [7, 2], [3], [3]]
    cache.roll_back(states, drafts, emitted, [True] * 4 + [False], layout)
    expected = [1, 2, 3, 9, 10, *range(6, 14)]  # slot 3 gets slot 8's state, slot 4 slot 9's
    assert caches[1][1].flatten().tolist() == expected
    assert caches[1][0][:, 0].tolist() == expected


def test_without_linear_attention_nothing_is_touched() -> None:
    cache = RecurrentStateCache(GROUPS[:1], BLOCK, torch.device("cpu"))
    cache.bind([torch.ones(2, 4, BLOCK, 1, 1)])
    assert cache.groups == []
    cache.start_requests([SimpleNamespace(block_ids=([1],), num_computed_tokens=0)])
    cache.snapshot({}, {"absent": 4}, {})  # returns before reading any request
