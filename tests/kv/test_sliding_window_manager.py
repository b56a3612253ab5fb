"""Sliding-window block tables (W = 6: position p reads keys p - 5 .. p; blocks of 4 tokens):
exact block ids as blocks leave the window, hits that need only the window's blocks."""

from __future__ import annotations

import pytest

from ferrum.kv.sliding_window_manager import UNBOUNDED_TOKENS, SlidingWindowManager
from ferrum.request import Request
from ferrum.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, prompt_token_ids: list[int]) -> Request:
    return Request(req_id, prompt_token_ids, SamplingParams(max_tokens=64).resolve())


def ref_counts(manager: SlidingWindowManager) -> list[int]:
    return [manager.block_pool.ref_count(b) for b in range(manager.block_pool.num_blocks)]


def decode(manager: SlidingWindowManager, request: Request, sampled_token_id: int) -> None:
    """Computes the request's pending tokens, then appends the sampled one."""
    num_new = request.num_tokens - request.num_computed_tokens
    assert manager.allocate_slots(request, num_new) is not None
    request.num_computed_tokens = request.num_tokens
    request.append_output_token(sampled_token_id)


def sliding(num_blocks: int, max_num_batched_tokens: int = 4) -> SlidingWindowManager:
    return SlidingWindowManager(num_blocks, BS, 6, max_num_batched_tokens)


def compute_in_chunks(
    manager: SlidingWindowManager, request: Request, chunk: int
) -> list[list[int]]:
    """Computes the request's uncomputed tokens `chunk` at a time; the block table after each."""
    tables = []
    while request.num_computed_tokens < request.num_tokens:
        n = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert manager.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
        tables.append(manager.get_block_ids(request.req_id))
    return tables


def test_sliding_window_releases_blocks_that_left_every_future_window() -> None:
    manager = sliding(num_blocks=9)
    r1 = make_request("r1", list(range(17)))
    assert compute_in_chunks(manager, r1, 4) == [
        [1],
        [1, 2],
        [1, 2, 3],
        [0, 2, 3, 4],  # the chunk from position 12 reads keys from 7: block 0 is released
        [0, 0, 3, 4, 5],  # position 16 reads keys from 11
    ]
    assert ref_counts(manager) == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    # Cached released blocks go to the back of the free queue, the oldest first.
    assert manager.block_pool.free_block_ids == [6, 7, 8, 1, 2]
    for token in range(100, 120):  # decoding holds at most ceil(5 / 4) + 2 blocks
        decode(manager, r1, token)
        assert sum(b != 0 for b in manager.get_block_ids("r1")) <= 4
    manager.free(r1)
    assert manager.usage == 0.0


def test_sliding_window_hits_need_only_the_window_blocks() -> None:
    manager = sliding(num_blocks=9)
    prompt = list(range(17))
    r1 = make_request("r1", prompt)
    compute_in_chunks(manager, r1, 4)
    manager.free(r1)
    # Block 5 (partial) first, then the oldest cached ones: 1 and 2 were released mid-request.
    assert manager.block_pool.free_block_ids == [5, 6, 7, 8, 1, 2, 4, 3]
    # With everything cached, a hit covers every full block short of the last token.
    assert manager.get_computed_blocks(make_request("a", prompt)) == ([0, 0, 3, 4], 16)
    # Evict block 1 (tokens 0-3): the window of position 16 (keys 11..) is still cached.
    assert manager.allocate_slots(make_request("x", [9] * 20), 20) == [5, 6, 7, 8, 1]
    r2 = make_request("r2", prompt)
    computed, num_cached = manager.get_computed_blocks(r2)
    assert (computed, num_cached) == ([0, 0, 3, 4], 16)
    assert manager.allocate_slots(r2, 1, computed) == [0, 0, 3, 4, 2]
    assert manager.get_block_ids("r2") == [0, 0, 3, 4, 2]
    assert ref_counts(manager)[2:5] == [1, 1, 1]
    # Blocks 1 and 2 are taken by others now: every window of a shorter prompt needs one.
    assert manager.get_computed_blocks(make_request("b", prompt[:13])) == ([], 0)


def test_sliding_window_hits_are_verified_and_checked_on_admission() -> None:
    manager = sliding(num_blocks=9)
    prompt = list(range(17))
    r1 = make_request("r1", prompt)
    compute_in_chunks(manager, r1, 4)
    # Other tokens in block 3: the hit stops before it, and position 12 reads keys from 7.
    assert manager.get_computed_blocks(make_request("c", prompt[:12] + [0] * 5)) == ([0, 2, 3], 12)
    r2 = make_request("r2", prompt)
    with pytest.raises(ValueError, match="do not cache the window"):
        manager.allocate_slots(r2, 1, [0, 0, 3, 5])


def test_sliding_window_pool_bounds_request_length_only_when_the_window_does_not_fit() -> None:
    # A window and a chunk need ceil((5 + 4) / 4) + 1 = 4 blocks.
    assert sliding(num_blocks=5).max_tokens_in_pool() == UNBOUNDED_TOKENS
    assert sliding(num_blocks=4).max_tokens_in_pool() == 12
    with pytest.raises(ValueError, match="sliding_window must be an integer >= 1"):
        SlidingWindowManager(4, BS, 0, 4)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be an integer >= 1"):
        SlidingWindowManager(4, BS, 6, 0)
