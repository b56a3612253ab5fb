"""The scheduler under pipeline parallelism (pipeline_depth steps in flight): the steps split
the requests between them, a request whose token is still in the pipe waits for it, and a
prompt's next chunk follows its previous one into the pipe."""

from __future__ import annotations

import pytest

from ferrum.request import RequestStatus
from tests.utils.scheduler_steps import complete, launch, make_request, make_scheduler


def test_steps_in_flight_split_the_requests_and_wait_for_their_tokens() -> None:
    s = make_scheduler(pipeline_depth=2)
    for i, req_id in enumerate("abcd"):
        s.add_request(make_request(req_id, 3, max_tokens=3, start=10 * i))
    out1, sampled1 = launch(s)
    assert out1.num_scheduled_tokens == {"a": 3, "b": 3} and sampled1 == ["a", "b"]
    # a and b have a token in the pipe: the next step takes the other half.
    out2, sampled2 = launch(s)
    assert out2.num_scheduled_tokens == {"c": 3, "d": 3} and sampled2 == ["c", "d"]
    out3, _ = launch(s)
    assert out3.is_empty
    complete(s, out1, sampled1, [1, 2])
    complete(s, out3, [], [])
    out4, sampled4 = launch(s)
    assert out4.num_scheduled_tokens == {"a": 1, "b": 1} and sampled4 == ["a", "b"]
    complete(s, out2, sampled2, [3, 4])
    out5, _ = launch(s)
    assert out5.num_scheduled_tokens == {"c": 1, "d": 1}
    assert s.requests["a"].output_token_ids == [1] and s.requests["c"].output_token_ids == [3]


def test_a_long_queue_does_not_put_every_running_request_in_one_step() -> None:
    s = make_scheduler(max_seqs=4, pipeline_depth=2)
    for i in range(12):
        s.add_request(make_request(f"r{i}", 2, max_tokens=50, start=10 * i))
    steps = [launch(s)[0].num_scheduled_tokens for _ in range(2)]
    # max_num_seqs=4 may run: two per step, the queue of 8 more does not raise the share.
    assert [len(step) for step in steps] == [2, 2]
    assert len(s.running) == 4


def test_a_long_prompt_sends_its_next_chunk_while_the_previous_is_in_the_pipe() -> None:
    s = make_scheduler(budget=8, pipeline_depth=2)
    s.add_request(make_request("a", 20, max_tokens=2))
    chunks = [launch(s)[0].num_scheduled_tokens for _ in range(3)]
    assert chunks == [{"a": 8}, {"a": 8}, {"a": 4}]
    a = s.requests["a"]
    assert (a.num_computed_tokens, a.num_output_placeholders) == (20, 1)
    assert launch(s)[0].is_empty  # its first token is still in the pipe


def test_pipeline_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="pipeline_depth"):
        make_scheduler(pipeline_depth=0)


def test_a_request_preempted_with_its_token_in_the_pipe_waits_for_that_token() -> None:
    # Three steps in flight: b is preempted while its first token is in the pipe and must not
    # be recomputed (admitted again) before that token arrives, even with room for it.
    s = make_scheduler(num_blocks=5, budget=8, max_seqs=2, pipeline_depth=3, caching=False)
    s.add_request(make_request("a", 8, max_tokens=8))
    s.add_request(make_request("b", 7, max_tokens=8, start=100))
    out_a, sampled_a = launch(s)  # a's prompt: two blocks, its token in the pipe
    out_b, sampled_b = launch(s)  # b's prompt: two blocks, its token in the pipe
    assert (sampled_a, sampled_b) == (["a"], ["b"])
    complete(s, out_a, sampled_a, [1])
    out_3, _ = launch(s)  # a's decode needs a third block: b, the newest, is preempted
    assert out_3.num_scheduled_tokens == {"a": 1} and out_3.preempted_req_ids == {"b"}
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # room for b again
    assert "b" not in launch(s)[0].num_scheduled_tokens  # but its token is in the pipe
    complete(s, out_b, sampled_b, [2])
    out_5, _ = launch(s)
    (new,) = out_5.scheduled_new_reqs
    assert new.output_token_ids == [2]  # recomputed with its token: 7 + 1
    assert out_5.num_scheduled_tokens == {"b": 8}
