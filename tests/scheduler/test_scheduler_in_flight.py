"""Scheduler with steps in flight (async scheduling) and failed steps, with exact values.

A launched step's sampled token is a placeholder until its output is applied: the next step is
scheduled over it, never past max_tokens, and outputs are matched to the requests of their own
step. A failed step's requests are recomputed and its prefix-cache entries dropped.
"""

from __future__ import annotations

from ferrum.request import RequestStatus
from tests.utils.scheduler_steps import complete, launch, make_request, make_scheduler, run_step


def test_a_decode_is_scheduled_over_its_placeholder_but_not_past_max_tokens() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 6, max_tokens=4))
    a = s.requests["a"]
    out1, sampled = launch(s)
    assert (out1.step_id, out1.num_scheduled_tokens, sampled) == (1, {"a": 6}, ["a"])
    assert (a.num_computed_tokens, a.num_output_placeholders) == (6, 1)
    # Step 2 decodes the token step 1 is still sampling: its input is read on the device.
    out2, sampled = launch(s)
    assert (out2.step_id, out2.num_scheduled_tokens, sampled) == (2, {"a": 1}, ["a"])
    assert [(c.new_block_ids[0], c.num_computed_tokens) for c in out2.scheduled_cached_reqs] == [
        ([], 6)
    ]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (7, 2)

    assert [(u.new_token_ids, u.finished) for u in complete(s, out1, ["a"], [100])] == [
        ([100], False)
    ]
    assert (a.num_tokens, a.num_output_placeholders) == (7, 1)
    out3, _ = launch(s)
    complete(s, out2, ["a"], [101])
    out4, _ = launch(s)
    assert out3.num_scheduled_tokens == out4.num_scheduled_tokens == {"a": 1}
    assert out4.scheduled_cached_reqs[0].new_block_ids[0] == [3]  # token 8 opens the third block
    complete(s, out3, ["a"], [102])
    # 3 tokens known + 1 in flight = max_tokens: nothing more to compute.
    assert (a.num_computed_tokens, a.num_output_tokens, a.num_output_placeholders) == (9, 3, 1)
    out5, sampled = launch(s)
    assert out5.is_empty and out5.num_scheduled_tokens == {} and sampled == []
    (update,) = complete(s, out4, ["a"], [103])
    assert update.finished and a.status == RequestStatus.FINISHED_LENGTH
    assert a.output_token_ids == [100, 101, 102, 103] and a.num_output_placeholders == 0
    assert complete(s, out5, [], []) == []
    assert s.requests == {} and s.kv_cache_manager.usage == 0.0


def test_preempted_with_a_token_in_flight_the_request_keeps_that_token() -> None:
    # 5 usable blocks of 4 tokens: two 8-token prompts take 4; only one can grow into a third.
    s = make_scheduler(num_blocks=6, caching=False)
    s.add_request(make_request("old", 8, max_tokens=8))
    s.add_request(make_request("new", 8, max_tokens=8, start=50))
    new = s.requests["new"]
    out1, sampled = launch(s)
    assert [r.block_ids[0] for r in out1.scheduled_new_reqs] == [[1, 2], [3, 4]]
    assert sampled == ["old", "new"]
    out2, sampled = launch(s)
    assert (out2.num_scheduled_tokens, out2.preempted_req_ids, sampled) == (
        {"old": 1},
        {"new"},
        ["old"],
    )
    assert out2.scheduled_cached_reqs[0].new_block_ids[0] == [5]
    assert new.status == RequestStatus.PREEMPTED and list(s.waiting) == [new]
    assert (new.num_computed_tokens, new.num_output_placeholders) == (0, 0)

    updates = complete(s, out1, ["old", "new"], [100, 200])
    assert [(u.request.req_id, u.new_token_ids, u.finished) for u in updates] == [
        ("old", [100], False),
        ("new", [200], False),
    ]
    assert (new.output_token_ids, new.num_tokens, new.num_output_placeholders) == ([200], 9, 0)
    complete(s, out2, ["old"], [101])
    while "old" in s.requests:
        out, _ = run_step(s)
        assert "new" not in out.num_scheduled_tokens
    out, _ = run_step(s, token=201)
    # Recomputed with the token sampled while it was preempted, as if it had come before.
    (resumed,) = out.scheduled_new_reqs
    assert (resumed.req_id, resumed.output_token_ids, resumed.num_computed_tokens) == (
        "new",
        [200],
        0,
    )
    assert out.num_scheduled_tokens == {"new": 9} and len(resumed.block_ids[0]) == 3
    assert new.output_token_ids == [200, 201] and new.num_preemptions == 1


def test_outputs_go_to_the_requests_of_their_own_step_when_an_id_is_reused() -> None:
    s = make_scheduler()
    s.add_request(make_request("x", 4, max_tokens=4, stop_token_ids=[9]))
    first = s.requests["x"]
    out1, _ = launch(s)
    out2, _ = launch(s)  # decodes "x" over its placeholder
    (update,) = complete(s, out1, ["x"], [9])
    assert update.finished and first.status == RequestStatus.FINISHED_STOPPED
    assert first.stop_reason == 9 and s.requests == {}

    s.add_request(make_request("x", 5, max_tokens=2, start=40))
    second = s.requests["x"]
    out3, sampled = launch(s)
    assert out3.finished_req_ids == {"x"} and [r.req_id for r in out3.scheduled_new_reqs] == ["x"]
    assert sampled == ["x"]
    # Step 2 ran the finished "x": its token is dropped, not given to the new "x".
    assert complete(s, out2, ["x"], [77]) == []
    assert first.output_token_ids == [9] and second.output_token_ids == []
    (update,) = complete(s, out3, ["x"], [5])
    assert update.request is second and second.output_token_ids == [5]
    assert second.num_output_placeholders == 0


def test_a_request_aborted_while_its_step_runs_gets_no_token() -> None:
    s = make_scheduler(caching=False)
    s.add_request(make_request("a", 5))
    s.add_request(make_request("b", 5, start=10))
    a = s.requests["a"]
    out1, sampled = launch(s)
    assert sampled == ["a", "b"]
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    updates = complete(s, out1, sampled, [1, 2])
    assert [(u.request.req_id, u.new_token_ids) for u in updates] == [("b", [2])]
    assert a.output_token_ids == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert s.schedule().finished_req_ids == {"a"}


def test_a_failed_step_requeues_its_requests_in_order_and_tells_the_runner() -> None:
    s = make_scheduler(max_seqs=2)
    for i, req_id in enumerate("abcd"):
        s.add_request(make_request(req_id, 6, start=10 * i))
    s.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    a, b = s.requests["a"], s.requests["b"]
    out1, _ = launch(s)
    assert out1.num_scheduled_tokens == {"a": 6, "b": 6} and out1.finished_req_ids == {"d"}
    assert s.kv_cache_manager.groups[0].block_pool.num_cached_blocks == 2  # block 1 of each prompt

    s.recover_from_failed_step(out1)
    assert s.running == [] and [r.req_id for r in s.waiting] == ["a", "b", "c"]
    for request in (a, b):
        assert request.status == RequestStatus.PREEMPTED and request.num_preemptions == 1
        assert (request.num_computed_tokens, request.num_output_placeholders) == (0, 0)
    assert s.num_preemptions == 2 and s.kv_cache_manager.usage == 0.0
    # No KV of the failed step exists: its prefix-cache entries are gone.
    assert s.kv_cache_manager.groups[0].block_pool.num_cached_blocks == 0

    out2, sampled = launch(s)
    assert out2.preempted_req_ids == {"a", "b"} and out2.finished_req_ids == {"d"}
    assert [(r.req_id, r.num_computed_tokens) for r in out2.scheduled_new_reqs] == [
        ("a", 0),
        ("b", 0),
    ]
    assert out2.num_scheduled_tokens == {"a": 6, "b": 6} and sampled == ["a", "b"]
    assert s.kv_cache_manager.prefix_cache_hits == 0
    assert s.schedule().preempted_req_ids == set()


def test_a_failed_step_keeps_the_cache_entries_of_the_step_before_it() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 8))
    a = s.requests["a"]
    run_step(s, token=100)
    pool = s.kv_cache_manager.groups[0].block_pool
    assert pool.num_cached_blocks == 2
    s.add_request(make_request("b", 8, start=50))
    out2, _ = launch(s)
    assert out2.num_scheduled_tokens == {"a": 1, "b": 8} and pool.num_cached_blocks == 4

    s.recover_from_failed_step(out2)
    assert pool.num_cached_blocks == 2 and a.output_token_ids == [100]
    out3, _ = launch(s)
    # "a" finds its prompt's blocks again; "b"'s entries were dropped with the failed step.
    assert [(r.req_id, r.num_computed_tokens) for r in out3.scheduled_new_reqs] == [
        ("a", 8),
        ("b", 0),
    ]
    assert out3.scheduled_new_reqs[0].block_ids[0][:2] == [1, 2]
    assert out3.num_scheduled_tokens == {"a": 1, "b": 8}


def test_a_device_failure_with_two_steps_in_flight_loses_both() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 8))
    a = s.requests["a"]
    out1, _ = launch(s)
    out2, _ = launch(s)
    assert a.num_output_placeholders == 2
    # The engine core recovers every launched step, oldest first.
    s.recover_from_failed_step(out1)
    s.recover_from_failed_step(out2)
    assert [r.req_id for r in s.waiting] == ["a"] and a.num_preemptions == 1
    assert (a.num_computed_tokens, a.num_output_placeholders, a.output_token_ids) == (0, 0, [])
    assert s.kv_cache_manager.groups[0].block_pool.num_cached_blocks == 0
    out3, sampled = launch(s)
    assert out3.num_scheduled_tokens == {"a": 8} and out3.preempted_req_ids == {"a"}
    assert out3.scheduled_new_reqs[0].num_computed_tokens == 0 and sampled == ["a"]
