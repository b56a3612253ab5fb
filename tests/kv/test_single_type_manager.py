from __future__ import annotations

import random
from collections import Counter

import pytest

from ferrum.kv import block_hash
from ferrum.kv.block_hash import NONE_HASH
from ferrum.kv.single_type_manager import FullAttentionManager
from ferrum.request import Request
from ferrum.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(req_id, prompt_token_ids, SamplingParams(max_tokens=64).resolve())


def admit(manager: FullAttentionManager, request: Request) -> list[int] | None:
    """Admits a request as the scheduler does and computes all its tokens in one step."""
    computed_blocks, num_cached = manager.get_computed_blocks(request)
    new_block_ids = manager.allocate_slots(
        request, request.num_tokens - num_cached, computed_blocks
    )
    if new_block_ids is not None:
        request.num_computed_tokens = request.num_tokens
    return new_block_ids


def decode(manager: FullAttentionManager, request: Request, sampled_token_id: int) -> list[int]:
    """Computes the request's pending tokens, then appends the sampled one."""
    new_block_ids = manager.allocate_slots(
        request, request.num_tokens - request.num_computed_tokens
    )
    assert new_block_ids is not None
    request.num_computed_tokens = request.num_tokens
    request.append_output_token(sampled_token_id)
    return new_block_ids


def ref_counts(manager: FullAttentionManager) -> list[int]:
    return [manager.block_pool.ref_count(b) for b in range(manager.block_pool.num_blocks)]


def test_fresh_pool_allocates_increasing_ids() -> None:
    manager = FullAttentionManager(num_blocks=10, block_size=BS)
    r1 = make_request("r1", list(range(10)))
    r2 = make_request("r2", list(range(100, 105)))
    assert admit(manager, r1) == [1, 2, 3]
    assert admit(manager, r2) == [4, 5]
    assert manager.get_block_ids("r1") == [1, 2, 3]
    assert manager.get_block_ids("r2") == [4, 5]
    assert ref_counts(manager) == [0, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert manager.block_pool.free_block_ids == [6, 7, 8, 9]


def test_short_pool_returns_none_and_changes_nothing() -> None:
    manager = FullAttentionManager(num_blocks=6, block_size=BS)
    r1 = make_request("r1", list(range(9)))
    assert admit(manager, r1) == [1, 2, 3]
    manager.free(r1)
    other = make_request("other", [50, 51, 52])
    assert admit(manager, other) == [3]
    assert manager.block_pool.free_block_ids == [4, 5, 2, 1]

    # Hits blocks 1 and 2 (both free), then needs 3 fresh blocks: touching the hits would leave 2.
    r2 = make_request("r2", list(range(8)) + list(range(200, 209)))
    computed_blocks, num_cached = manager.get_computed_blocks(r2)
    assert (computed_blocks, num_cached) == ([1, 2], 8)
    assert manager.allocate_slots(r2, r2.num_tokens - num_cached, computed_blocks) is None
    assert manager.get_block_ids("r2") == []
    assert ref_counts(manager) == [0, 0, 0, 1, 0, 0]
    assert manager.block_pool.free_block_ids == [4, 5, 2, 1]
    assert manager.num_free_blocks == 4

    manager.free(other)
    computed_blocks, num_cached = manager.get_computed_blocks(r2)
    assert manager.allocate_slots(r2, r2.num_tokens - num_cached, computed_blocks) == [
        1,
        2,
        3,
        4,
        5,
    ]


def test_free_releases_tail_first_and_evicts_least_recently_freed() -> None:
    manager = FullAttentionManager(num_blocks=8, block_size=BS)
    r1 = make_request("r1", list(range(10)))
    r2 = make_request("r2", list(range(100, 108)))
    assert admit(manager, r1) == [1, 2, 3]
    assert admit(manager, r2) == [4, 5]
    manager.free(r2)
    assert manager.block_pool.free_block_ids == [6, 7, 5, 4]
    # Block 3 holds a partial block (no hash): it goes to the front.
    manager.free(r1)
    assert manager.block_pool.free_block_ids == [3, 6, 7, 5, 4, 2, 1]
    assert manager.usage == 0.0

    assert admit(manager, make_request("x", [7, 7, 7])) == [3]
    assert admit(manager, make_request("y", [8] * 8)) == [6, 7]
    # Evicts r2's tail block 5; its head block 4 and all of r1 stay cached.
    assert admit(manager, make_request("z", [9, 9])) == [5]
    assert manager.block_pool.free_block_ids == [4, 2, 1]
    assert manager.get_computed_blocks(make_request("r2b", list(range(100, 109)))) == ([4], 4)
    assert manager.get_computed_blocks(make_request("r1b", list(range(10)))) == ([1, 2], 8)


def test_shared_prefix_shares_blocks() -> None:
    manager = FullAttentionManager(num_blocks=10, block_size=BS)
    r1 = make_request("r1", list(range(9)))
    r2 = make_request("r2", list(range(8)) + [100, 101])
    assert admit(manager, r1) == [1, 2, 3]
    assert manager.get_computed_blocks(r2) == ([1, 2], 8)
    assert admit(manager, r2) == [1, 2, 4]
    assert ref_counts(manager)[:6] == [0, 2, 2, 1, 1, 0]
    assert manager.usage == pytest.approx(4 / 9)

    manager.free(r1)
    assert ref_counts(manager)[:6] == [0, 1, 1, 0, 1, 0]
    assert manager.block_pool.free_block_ids == [3, 5, 6, 7, 8, 9]
    manager.free(r2)
    assert manager.block_pool.free_block_ids == [4, 3, 5, 6, 7, 8, 9, 2, 1]


def test_hit_never_covers_the_last_token() -> None:
    manager = FullAttentionManager(num_blocks=10, block_size=BS)
    r1 = make_request("r1", list(range(8)))
    assert admit(manager, r1) == [1, 2]
    assert manager.block_pool.entry(2) is not None
    r2 = make_request("r2", list(range(8)))
    assert manager.get_computed_blocks(r2) == ([1], 4)
    assert admit(manager, r2) == [1, 3]
    # r2 recomputed block 2's content into block 3: only the first copy is registered.
    assert manager.block_pool.entry(3) is None
    assert manager.get_computed_blocks(make_request("r3", list(range(4)))) == ([], 0)
    assert manager.get_computed_blocks(make_request("r4", list(range(9)))) == ([1, 2], 8)
    manager.free(r2)
    assert manager.block_pool.free_block_ids == [3, 4, 5, 6, 7, 8, 9]
    assert ref_counts(manager)[:3] == [0, 1, 1]


def test_constant_hash_never_gives_a_wrong_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_hash, "hash_block_tokens", lambda parent, tokens, extra=None: 42)
    manager = FullAttentionManager(num_blocks=10, block_size=BS)
    r1 = make_request("r1", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(manager, r1) == [1, 2, 3]
    assert r1.block_hashes == [42, 42]
    assert manager.block_pool.entry(1) is not None
    assert manager.block_pool.entry(2) is None
    assert manager.get_computed_blocks(make_request("a", [1, 2, 3, 4, 50, 51, 52, 53, 9])) == (
        [1],
        4,
    )
    assert manager.get_computed_blocks(make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])) == ([], 0)
    assert manager.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5, 6, 7, 8, 9])) == ([1], 4)


def test_hash_ignoring_the_parent_never_gives_a_wrong_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        block_hash, "hash_block_tokens", lambda parent, tokens, extra=None: hash(tuple(tokens))
    )
    manager = FullAttentionManager(num_blocks=10, block_size=BS)
    assert admit(manager, make_request("t", [7, 7, 7, 7, 1, 2, 3, 4, 0])) == [1, 2, 3]
    r = make_request("r", [5, 5, 5, 5, 1, 2, 3, 4, 0])
    assert admit(manager, r) == [4, 5, 6]
    # Block 2 holds [1, 2, 3, 4] after [7, 7, 7, 7]; r's copy after [5, 5, 5, 5] is not cached.
    assert manager.block_pool.entry(5) is None
    q = make_request("q", [5, 5, 5, 5, 1, 2, 3, 4, 9])
    assert manager.get_computed_blocks(q) == ([4], 4)


def test_collision_with_the_root_hash_never_gives_a_wrong_hit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every block hashes like a first block: only the parent's identity tells them apart.
    monkeypatch.setattr(
        block_hash, "hash_block_tokens", lambda parent, tokens, extra=None: NONE_HASH
    )
    manager = FullAttentionManager(num_blocks=4, block_size=BS)
    s = make_request("s", [9, 9, 9, 9, 0])
    assert admit(manager, s) == [1, 2]
    t = make_request("t", [7, 7, 7, 7, 1, 2, 3, 4, 0])
    assert manager.get_computed_blocks(t) == ([], 0)
    assert manager.allocate_slots(t, 4) == [3]
    t.num_computed_tokens = 4
    manager.free(s)
    # Evicts block 1 (s's cached block), so t's second block registers the hash.
    assert manager.allocate_slots(t, 5) == [2, 1]
    entry = manager.block_pool.entry(2)
    assert entry is not None and entry.token_ids == (1, 2, 3, 4)
    manager.free(t)
    # Same tokens and hash as block 2, but block 2's KV was computed after [7, 7, 7, 7].
    assert manager.get_computed_blocks(make_request("q", [1, 2, 3, 4, 0])) == ([], 0)


def test_decode_tokens_fill_and_cache_blocks() -> None:
    manager = FullAttentionManager(num_blocks=10, block_size=BS)
    r1 = make_request("r1", list(range(6)))
    assert admit(manager, r1) == [1, 2]
    assert len(r1.block_hashes) == 1
    r1.append_output_token(6)
    assert decode(manager, r1, 7) == []
    assert manager.block_pool.entry(2) is None
    assert decode(manager, r1, 8) == []
    assert len(r1.block_hashes) == 2
    assert manager.block_pool.entry(2) is not None
    assert decode(manager, r1, 9) == [3]
    assert manager.get_block_ids("r1") == [1, 2, 3]
    assert manager.get_computed_blocks(make_request("r2", list(range(8)) + [99])) == ([1, 2], 8)


def test_chunked_prefill_caches_only_computed_full_blocks() -> None:
    manager = FullAttentionManager(num_blocks=10, block_size=BS)
    r1 = make_request("r1", list(range(10)))
    assert manager.allocate_slots(r1, 5) == [1, 2]
    assert manager.block_pool.entry(1) is not None
    assert manager.block_pool.entry(2) is None
    r1.num_computed_tokens = 5
    assert manager.allocate_slots(r1, 5) == [3]
    assert manager.block_pool.entry(2) is not None
    assert manager.block_pool.entry(3) is None
    # Slots past the known tokens are allocated but nothing beyond num_tokens is cached.
    r2 = make_request("r2", list(range(50, 57)))
    assert manager.allocate_slots(r2, 9) == [4, 5, 6]
    assert len(r2.block_hashes) == 1
    assert [manager.block_pool.entry(b) is not None for b in (4, 5, 6)] == [True, False, False]


def test_preempted_request_hits_its_own_blocks_on_readmission() -> None:
    manager = FullAttentionManager(num_blocks=10, block_size=BS)
    r1 = make_request("r1", list(range(9)))
    assert admit(manager, r1) == [1, 2, 3]
    r1.append_output_token(9)
    manager.free(r1)
    r1.num_computed_tokens = 0
    assert manager.get_computed_blocks(r1) == ([1, 2], 8)
    assert admit(manager, r1) == [1, 2, 3]
    assert ref_counts(manager)[:5] == [0, 1, 1, 1, 0]


def test_reset_prefix_cache() -> None:
    manager = FullAttentionManager(num_blocks=6, block_size=BS)
    r1 = make_request("r1", list(range(9)))
    assert admit(manager, r1) == [1, 2, 3]
    assert manager.reset_prefix_cache() is False
    assert manager.get_computed_blocks(make_request("a", list(range(9)))) == ([1, 2], 8)
    manager.free(r1)
    assert manager.block_pool.free_block_ids == [3, 4, 5, 2, 1]
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.free_block_ids == [1, 2, 3, 4, 5]
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_prefix_caching_disabled() -> None:
    manager = FullAttentionManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    r1 = make_request("r1", list(range(9)))
    r2 = make_request("r2", list(range(9)))
    assert manager.get_computed_blocks(r1) == ([], 0)
    assert admit(manager, r1) == [1, 2, 3]
    assert admit(manager, r2) == [4, 5, 6]
    assert r1.block_hashes == []
    assert manager.block_pool.num_cached_blocks == 0
    manager.free(r1)
    assert manager.block_pool.free_block_ids == [1, 2, 3, 7]


def test_usage_and_pool_capacity() -> None:
    manager = FullAttentionManager(num_blocks=11, block_size=BS)
    assert (manager.num_usable_blocks, manager.max_tokens_in_pool()) == (10, 40)
    assert manager.usage == 0.0
    r1 = make_request("r1", list(range(12)))
    r2 = make_request("r2", list(range(8)) + [99])
    assert admit(manager, r1) == [1, 2, 3]
    assert manager.usage == pytest.approx(0.3)
    assert admit(manager, r2) == [1, 2, 4]
    assert manager.usage == pytest.approx(0.4)
    assert manager.num_free_blocks == 6
    manager.free(r1)
    assert (manager.usage, manager.num_free_blocks) == (pytest.approx(0.3), 7)
    manager.free(r2)
    assert (manager.usage, manager.num_free_blocks) == (0.0, 10)
    assert manager.block_pool.num_cached_blocks == 3
    assert admit(manager, make_request("big", list(range(500, 541)))) is None
    assert admit(manager, make_request("full", list(range(500, 540)))) == [*range(4, 11), 3, 2, 1]
    assert manager.usage == 1.0


def test_free_is_idempotent_and_block_ids_are_a_copy() -> None:
    manager = FullAttentionManager(num_blocks=5, block_size=BS)
    r1 = make_request("r1", [1, 2, 3])
    admit(manager, r1)
    manager.get_block_ids("r1").append(4)
    assert manager.get_block_ids("r1") == [1]
    manager.free(r1)
    manager.free(r1)
    assert manager.get_block_ids("r1") == []
    assert manager.block_pool.free_block_ids == [1, 2, 3, 4]


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        FullAttentionManager(num_blocks=1, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        FullAttentionManager(num_blocks=4, block_size=0)
    manager = FullAttentionManager(num_blocks=6, block_size=BS)
    r1 = make_request("r1", list(range(9)))
    with pytest.raises(ValueError, match="num_new_tokens"):
        manager.allocate_slots(r1, -1)
    admit(manager, r1)
    with pytest.raises(ValueError, match="only for a request being admitted"):
        manager.allocate_slots(r1, 1, [1])
    manager.free(r1)
    r2 = make_request("r2", list(range(9)))
    computed_blocks, _ = manager.get_computed_blocks(r2)
    assert computed_blocks == [1, 2]
    # Evicts block 2 between lookup and allocation.
    assert admit(manager, make_request("x", list(range(100, 113)))) == [3, 4, 5, 2]
    with pytest.raises(ValueError, match=r"new_computed_blocks\[1\]=2 does not cache block 1"):
        manager.allocate_slots(r2, 1, computed_blocks)
    assert ref_counts(manager)[1] == 0


def _check_invariants(manager: FullAttentionManager, running: dict[str, Request]) -> None:
    pool = manager.block_pool
    held = Counter(b for req_id in running for b in manager.get_block_ids(req_id))
    assert ref_counts(manager) == [held[b] for b in range(pool.num_blocks)]
    assert sorted(pool.free_block_ids) == [b for b in range(1, pool.num_blocks) if held[b] == 0]
    for req_id, request in running.items():
        block_ids = manager.get_block_ids(req_id)
        assert len(block_ids) == -(-request.num_computed_tokens // manager.block_size)
        assert len(set(block_ids)) == len(block_ids)


@pytest.mark.parametrize("colliding_hash", [False, True])
def test_random_workload_hits_only_exact_prefixes(
    monkeypatch: pytest.MonkeyPatch, colliding_hash: bool
) -> None:
    """Tracks what each block holds (the tokens its KV was computed from) under random traffic."""
    if colliding_hash:
        monkeypatch.setattr(
            block_hash, "hash_block_tokens", lambda parent, tokens, extra=None: sum(tokens) % 3
        )
    rng = random.Random(0)
    manager = FullAttentionManager(num_blocks=14, block_size=3)
    size = manager.block_size
    block_content: dict[int, tuple[int, ...]] = {}
    running: dict[str, Request] = {}
    waiting: list[Request] = []
    num_hit_blocks = 0

    def compute(request: Request, first_token: int) -> None:
        block_ids = manager.get_block_ids(request.req_id)
        for pos in range(first_token, request.num_computed_tokens):
            block_content[block_ids[pos // size]] = tuple(request.all_token_ids[: pos + 1])

    for step in range(1500):
        op = rng.random()
        if op < 0.35 or not running:
            if waiting and rng.random() < 0.5:
                request = waiting.pop(0)
            else:
                prompt = [rng.randrange(2) for _ in range(rng.randrange(1, 12))]
                request = make_request(f"req{step}", prompt)
            computed_blocks, num_cached = manager.get_computed_blocks(request)
            for i, block_id in enumerate(computed_blocks):
                assert block_content[block_id] == tuple(request.all_token_ids[: (i + 1) * size])
            num_new = request.num_tokens - num_cached
            if manager.allocate_slots(request, num_new, computed_blocks) is None:
                waiting.append(request)
                continue
            num_hit_blocks += len(computed_blocks)
            request.num_computed_tokens = request.num_tokens
            compute(request, num_cached)
            request.append_output_token(rng.randrange(2))
            running[request.req_id] = request
        elif op < 0.8:
            request = rng.choice(list(running.values()))
            first_token = request.num_computed_tokens
            if manager.allocate_slots(request, request.num_tokens - first_token) is None:
                manager.free(request)
                del running[request.req_id]
                request.num_computed_tokens = 0
                waiting.append(request)
            else:
                request.num_computed_tokens = request.num_tokens
                compute(request, first_token)
                request.append_output_token(rng.randrange(2))
        else:
            request = running.pop(rng.choice(list(running)))
            manager.free(request)
        _check_invariants(manager, running)
    assert num_hit_blocks > (20 if colliding_hash else 100)
