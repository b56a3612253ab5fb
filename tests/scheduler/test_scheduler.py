"""Scheduler: token budget, chunked prefill, prefix hits, preemption, stops; exact block ids."""

from __future__ import annotations

import pytest

from ferrum.request import RequestStatus
from tests.utils.scheduler_steps import make_request, make_scheduler, run_step


def test_chunked_prefill_and_decodes_share_one_budget() -> None:
    s = make_scheduler(budget=16)
    for req_id, n, start in (("a", 10, 0), ("b", 20, 100), ("c", 5, 200)):
        s.add_request(make_request(req_id, n, start=start))
    out, updates = run_step(s)
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}
    assert [r.block_ids[0] for r in out.scheduled_new_reqs] == [[1, 2, 3], [4, 5]]
    assert [u.request.req_id for u in updates] == ["a"]  # b is mid-prompt: no token yet

    out, updates = run_step(s)
    # a decodes 1 token, b continues its prompt with 14, c gets the last token of budget.
    assert out.num_scheduled_tokens == {"a": 1, "b": 14, "c": 1}
    assert [
        (c.req_id, c.new_block_ids[0], c.num_computed_tokens) for c in out.scheduled_cached_reqs
    ] == [
        ("a", [], 10),
        ("b", [6, 7, 8], 6),
    ]
    assert out.scheduled_new_reqs[0].block_ids[0] == [9]
    assert out.total_num_scheduled_tokens == 16
    assert {u.request.req_id for u in updates} == {"a", "b"}


def test_max_num_seqs_limits_admission() -> None:
    s = make_scheduler(max_seqs=2)
    for i in range(3):
        s.add_request(make_request(str(i), 3, start=10 * i))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    assert s.num_waiting == 1


def test_prefix_cache_hit_skips_cached_blocks_but_never_the_last_token() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 9, max_tokens=1))  # blocks: [0-3] [4-7] [8]
    out, _ = run_step(s)
    assert out.scheduled_new_reqs[0].block_ids[0] == [1, 2, 3]
    # A request with the same first 8 tokens reuses blocks 1 and 2 (a finished, blocks cached).
    s.add_request(make_request("b", 12, max_tokens=1))
    out, _ = run_step(s)
    new = out.scheduled_new_reqs[0]
    assert (new.block_ids[0][:2], new.num_computed_tokens) == ([1, 2], 8)
    assert out.num_scheduled_tokens == {"b": 4}
    assert s.requests == {}
    # A prompt of exactly 2 cached blocks hits only the first: its last token must be computed.
    s.add_request(make_request("c", 8, max_tokens=1))
    out, _ = run_step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4
    assert out.num_scheduled_tokens == {"c": 4}
    assert s.kv_cache_manager.prefix_cache_hits == 12


def test_pool_exhaustion_preempts_the_newest_request_and_resumes_it() -> None:
    # 5 usable blocks of 4 tokens. Two prompts of 8 tokens take 4 blocks; growth needs more.
    s = make_scheduler(num_blocks=6, caching=False)
    s.add_request(make_request("old", 8, max_tokens=8))
    s.add_request(make_request("new", 8, max_tokens=8, start=50))
    out, _ = run_step(s)
    assert [r.block_ids[0] for r in out.scheduled_new_reqs] == [[1, 2], [3, 4]]
    out, _ = run_step(s)  # both decode into a third block: only one is left
    assert out.num_scheduled_tokens == {"old": 1}
    assert out.preempted_req_ids == {"new"}
    assert out.scheduled_cached_reqs[0].new_block_ids[0] == [5]
    preempted = next(iter(s.waiting))
    assert preempted.req_id == "new" and preempted.status == RequestStatus.PREEMPTED
    assert preempted.num_computed_tokens == 0 and preempted.num_preemptions == 1
    assert s.kv_cache_manager.get_block_ids("new") == ([],)
    # "old" runs to its end; then "new" is recomputed with its generated token.
    while "old" in s.requests:
        out, _ = run_step(s)
        assert "new" not in out.num_scheduled_tokens or "old" not in s.requests
    while not out.scheduled_new_reqs:
        out, _ = run_step(s)
    resumed = out.scheduled_new_reqs[0]
    assert resumed.req_id == "new" and resumed.output_token_ids == [1000]
    assert out.num_scheduled_tokens["new"] == 9


def test_a_request_that_can_never_fit_is_a_front_end_bug() -> None:
    # The front end refuses such requests (test_input_processor.py); the scheduler asserts.
    s = make_scheduler(num_blocks=5, max_len=64)  # 4 usable blocks = 16 tokens
    with pytest.raises(AssertionError):
        s.add_request(make_request("long", 60, max_tokens=10))
    with pytest.raises(AssertionError):
        s.add_request(make_request("big", 10, max_tokens=10))
    assert not s.has_unfinished_requests()


def test_stop_rules() -> None:
    s = make_scheduler()
    s.add_request(make_request("eos", 3, eos=1000))
    s.add_request(make_request("ignore", 3, start=10, eos=1000, ignore_eos=True, max_tokens=2))
    s.add_request(make_request("stop_id", 3, start=20, stop_token_ids=[1000]))
    s.add_request(make_request("min", 3, start=30, eos=1000, min_tokens=2, max_tokens=3))
    _, updates = run_step(s)
    finished = {u.request.req_id: u.request for u in updates if u.finished}
    assert finished["eos"].status == RequestStatus.FINISHED_STOPPED
    assert finished["eos"].stop_reason is None
    assert finished["stop_id"].stop_reason == 1000
    assert set(finished) == {"eos", "stop_id"}
    _, updates = run_step(s)
    finished = {u.request.req_id: u.request.status for u in updates if u.finished}
    assert finished == {
        "ignore": RequestStatus.FINISHED_LENGTH,
        "min": RequestStatus.FINISHED_STOPPED,
    }


def test_abort_frees_blocks_and_tells_the_runner() -> None:
    s = make_scheduler(caching=False)
    s.add_request(make_request("a", 6))
    s.add_request(make_request("b", 6, start=10))
    run_step(s)
    assert s.kv_cache_manager.usage > 0
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.usage == 0.0
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.is_empty
    assert s.schedule().finished_req_ids == set()


def test_abort_of_a_waiting_request() -> None:
    s = make_scheduler(max_seqs=1)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4, start=10))
    run_step(s)
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert s.num_waiting == 0 and list(s.requests) == ["a"]
