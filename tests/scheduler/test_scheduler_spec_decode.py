"""The scheduler with drafts: a decode verifies its drafts in the same step, within max_tokens,
max_model_len and the budget; rejected drafts move its computed count back; a stop token among
accepted drafts ends it there; drafts never preempt and never reach the prefix cache."""

from __future__ import annotations

from ferrum.scheduler.output import ModelRunnerOutput, SpecDecodeOutput
from tests.utils.scheduler_steps import make_request, make_scheduler


def _output(req_id: str, accepted: list[int], token: int, drafts: list[int]) -> ModelRunnerOutput:
    spec = SpecDecodeOutput({req_id: accepted}, {}, {req_id: drafts})
    return ModelRunnerOutput([req_id], [token], spec_decode=spec)


def test_drafts_are_verified_and_rejected_ones_roll_back() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 6, max_tokens=20))
    prefill = scheduler.schedule()
    assert prefill.num_scheduled_tokens == {"r": 6} and not prefill.scheduled_spec_decode_tokens
    scheduler.update_from_output(prefill, _output("r", [], 100, [101, 102, 103]))
    verify = scheduler.schedule()
    assert verify.num_scheduled_tokens == {"r": 4}
    assert verify.scheduled_spec_decode_tokens == {"r": [101, 102, 103]}
    # 101 accepted, 102 rejected: the step emits 101 and the target's 7.
    (update,) = scheduler.update_from_output(verify, _output("r", [101], 7, [8, 9]))
    request = scheduler.requests["r"]
    assert update.new_token_ids == [101, 7]
    assert request.output_token_ids == [100, 101, 7]
    assert request.num_computed_tokens == 6 + 2 == request.num_tokens - 1
    stats = scheduler.spec_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.accepted_per_position == [1, 0, 0]
    assert scheduler.schedule().scheduled_spec_decode_tokens == {"r": [8, 9]}


def test_drafts_stop_short_of_max_tokens_max_model_len_and_the_budget() -> None:
    scheduler = make_scheduler(budget=3)
    scheduler.add_request(make_request("r", 3, max_tokens=4))
    step = scheduler.schedule()
    scheduler.update_from_output(step, _output("r", [], 100, [1, 2, 3, 4]))
    step = scheduler.schedule()  # the budget: 3 tokens, so 2 drafts
    assert step.scheduled_spec_decode_tokens == {"r": [1, 2]}
    scheduler.update_from_output(step, _output("r", [1, 2], 5, [6, 7, 8]))
    # 4 outputs = max_tokens: finished, and no drafts are scheduled for it.
    assert "r" not in scheduler.requests
    short = make_scheduler(max_len=12)
    short.add_request(make_request("s", 8, max_tokens=4))
    step = short.schedule()
    short.update_from_output(step, _output("s", [], 100, [1, 2, 3]))
    # 9 tokens of max_model_len 12: the next token, 2 drafts and the sampled token make 12.
    assert short.schedule().scheduled_spec_decode_tokens == {"s": [1, 2]}


def test_a_stop_token_among_accepted_drafts_ends_the_request_there() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4, max_tokens=20, stop_token_ids=[42]))
    step = scheduler.schedule()
    scheduler.update_from_output(step, _output("r", [], 100, [41, 42, 43]))
    step = scheduler.schedule()
    (update,) = scheduler.update_from_output(step, _output("r", [41, 42, 43], 44, []))
    assert update.finished and update.new_token_ids == [41, 42]
    assert (
        scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_usable_blocks
    )


def test_drafts_are_dropped_rather_than_preempting_another_request() -> None:
    scheduler = make_scheduler(num_blocks=4, max_len=64)  # 3 usable blocks of 4 tokens
    scheduler.add_request(make_request("a", 3, max_tokens=9))
    scheduler.add_request(make_request("b", 3, max_tokens=9, start=50))
    step = scheduler.schedule()
    scheduler.update_from_output(step, ModelRunnerOutput(["a", "b"], [7, 8]))
    scheduler.requests["a"].spec_token_ids = [1, 2, 3, 4, 5]
    step = scheduler.schedule()
    assert step.num_scheduled_tokens == {"a": 1, "b": 1}
    assert not step.scheduled_spec_decode_tokens and scheduler.num_preemptions == 0


def test_a_request_aborted_mid_verification_leaks_no_kv() -> None:
    """r is aborted while its verify step is in flight; the step's output (its accepted drafts
    included) then arrives and is ignored for r; s goes on. Once s ends every block is free."""
    from ferrum.request import RequestStatus

    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 6, max_tokens=20))
    scheduler.add_request(make_request("s", 5, max_tokens=3, start=50))
    step = scheduler.schedule()
    spec = SpecDecodeOutput({}, {}, {"r": [1, 2, 3], "s": [4, 5]})
    scheduler.update_from_output(step, ModelRunnerOutput(["r", "s"], [100, 101], spec_decode=spec))
    verify = scheduler.schedule()
    # s: one draft left under max_tokens 3 (one output so far, and the step's own token).
    assert verify.scheduled_spec_decode_tokens == {"r": [1, 2, 3], "s": [4]}
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    spec = SpecDecodeOutput({"r": [1, 2], "s": [4]}, {}, {"r": [9], "s": []})
    updates = scheduler.update_from_output(
        verify, ModelRunnerOutput(["r", "s"], [7, 8], spec_decode=spec)
    )
    assert [u.request.req_id for u in updates] == ["s"]
    assert updates[0].new_token_ids == [4, 8] and updates[0].finished  # 3 outputs: max_tokens
    manager = scheduler.kv_cache_manager
    assert not scheduler.requests and manager.num_free_blocks == manager.num_usable_blocks
