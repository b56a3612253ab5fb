"""SchedulerOutput crosses process boundaries (one pickle per step for tensor-parallel workers):
its column-wise pickling gives back an equal step."""

from __future__ import annotations

import dataclasses
import pickle

from ferrum.lora_request import LoRAStep
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput


def test_pickled_step_is_equal() -> None:
    step = SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData("n", [1, 2, 3], [4], SamplingParams(temperature=0.5, seed=3), [7], 0)
        ],
        scheduled_cached_reqs=[CachedRequestData("a", [], 12), CachedRequestData("b", [9, 10], 40)],
        num_scheduled_tokens={"n": 4, "a": 1, "b": 3},
        total_num_scheduled_tokens=8,
        finished_req_ids={"x"},
        preempted_req_ids={"y"},
        step_id=17,
        scheduled_spec_decode_tokens={"b": [5, 6]},
        lora=LoRAStep({"n": 3}, {3: None}),
    )
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        copy = pickle.loads(pickle.dumps(step, protocol=protocol))
        assert copy == step
        assert [type(c) for c in copy.scheduled_cached_reqs] == [CachedRequestData] * 2
    # A new field must be added to SchedulerOutput.__reduce__ (and set above).
    assert {f.name for f in dataclasses.fields(SchedulerOutput)} == {
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
        "total_num_scheduled_tokens",
        "finished_req_ids",
        "preempted_req_ids",
        "step_id",
        "scheduled_spec_decode_tokens",
        "lora",
    }
    empty = SchedulerOutput([], [], {}, 0)
    assert pickle.loads(pickle.dumps(empty)) == empty
