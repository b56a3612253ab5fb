"""The linear-attention slots of a verifying step, with exact values: an eager step runs its rows
with drafts one position at a time (the others as chunks), a verify-shaped CUDA-graph batch every
row; the r-th request with drafts saves its states in scratch slots base + r * k + j."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum.model_executor.staging_buffer import StagingBuffer
from ferrum.model_executor.verify_states import (
    VerifyStateLayout,
    build_verify_states,
    verify_staging_bytes,
)

# Group 1 holds the linear-attention layers; 3 drafts at most; the KV manager owns slots 0..9.
LAYOUT = VerifyStateLayout(recurrent_group=1, num_speculative_tokens=3, scratch_base=10)


@dataclass
class Req:
    block_ids: tuple[list[int], ...]


def staging() -> StagingBuffer:
    return StagingBuffer(verify_staging_bytes(8, 4), torch.device("cpu"))


def test_an_eager_step_runs_its_rows_with_drafts_one_position_at_a_time() -> None:
    requests = {
        "prompt": Req(([1, 2], [5])),
        "two": Req(([3], [6])),
        "decode": Req(([4], [7])),
        "three": Req(([8], [9])),
    }
    scheduled = {"prompt": 7, "two": 3, "decode": 1, "three": 4}
    drafts = {"two": [11, 12], "three": [13, 14, 15]}
    states = build_verify_states(staging(), LAYOUT, requests, scheduled, drafts, None)
    assert states is not None and states.query_len == 4
    assert states.step_slots.tolist() == [-1, 6, -1, 9]
    assert states.prefill_slots is not None and states.prefill_slots.tolist() == [5, -1, 7, -1]
    # "two" is verifying row 0 (slots 10, 11), "three" row 1 (13, 14, 15): token j reads the
    # state of entry j and writes entry j + 1.
    assert states.state_slots.tolist() == [
        [0, 0, 0, 0, 0],
        [6, 10, 11, 6, 6],
        [0, 0, 0, 0, 0],
        [9, 13, 14, 15, 9],
    ]


def test_a_step_without_drafts_has_none_unless_it_runs_a_verify_graph() -> None:
    requests = {"a": Req(([1], [5])), "b": Req(([2], [6]))}
    scheduled = {"a": 2, "b": 3}
    assert build_verify_states(staging(), LAYOUT, requests, scheduled, {}, None) is None
    assert not LAYOUT.is_verify_shape((4, 4)) and not LAYOUT.is_verify_shape((16, 1 + 1))
    # A verify graph of 4 rows of 4 tokens: every row (padding: the null slot) per position.
    states = build_verify_states(staging(), LAYOUT, requests, scheduled, {"b": [9, 9]}, (16, 4))
    assert states is not None and states.query_len == 4 and states.prefill_slots is None
    assert states.step_slots.tolist() == [5, 6, 0, 0]
    assert states.state_slots.tolist() == [[5] * 5, [6, 10, 11, 6, 6], [0] * 5, [0] * 5]
