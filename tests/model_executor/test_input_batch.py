"""One step's model inputs from the scheduled tokens, with exact values: token order, positions,
slots, per-request rows, sampled rows and placeholders for tokens still being sampled on the
device. Blocks hold 4 tokens. (CUDA-graph padding: tests/model_executor/test_cuda_graph.py.)"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum.model_executor.input_batch import InputBuffers, profile_batch

BLOCK = 4
MAX_MODEL_LEN = 64  # 16 blocks per request


@dataclass
class Req:
    token_ids: list[int]
    block_ids: list[int] | tuple[list[int], ...]
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.block_ids, list):  # one KV cache group
            self.block_ids = (self.block_ids,)


def make_buffers() -> InputBuffers:
    return InputBuffers(
        max_num_tokens=32,
        max_num_reqs=4,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        device=torch.device("cpu"),
    )


def test_a_mixed_batch_flattens_in_scheduling_order() -> None:
    requests = {
        # A prompt chunk from position 4 (mid-prompt: samples nothing).
        "chunk": Req(list(range(100, 110)), [7, 3, 9], num_computed_tokens=4),
        # A decode of a known token.
        "decode": Req(list(range(200, 206)), [5, 6], num_computed_tokens=5),
        # A decode of the token the previous launched step samples (row 3 of its output).
        "pending": Req([1, 2, 3, 4], [2, 8], num_computed_tokens=4, num_output_placeholders=1),
    }
    scheduled = {"chunk": 5, "decode": 1, "pending": 1}
    inputs = make_buffers().prepare(requests, scheduled, 7, {"pending": 3})
    assert inputs.input_ids.tolist() == [104, 105, 106, 107, 108, 205, 0]
    assert inputs.positions.tolist() == [4, 5, 6, 7, 8, 5, 4]
    meta = inputs.attn_metadata
    # Position p of a request goes to slot block_ids[p // 4] * 4 + p % 4.
    assert meta.slot_mapping[0].tolist() == [12, 13, 14, 15, 36, 25, 32]
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu == [0, 5, 6, 7]
    assert meta.seq_lens.tolist() == meta.seq_lens_cpu == [9, 6, 5]
    assert meta.block_tables[0].shape == (3, 3)  # as wide as the longest table
    assert [
        row[: len(r.block_ids[0])]
        for row, r in zip(meta.block_tables[0].tolist(), requests.values())
    ] == [
        [7, 3, 9],
        [5, 6],
        [2, 8],
    ]
    assert (meta.num_reqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (3, 7, 5, 9)
    assert inputs.sampled_req_ids == ["decode", "pending"]
    assert inputs.logits_indices.tolist() == [5, 6]
    assert inputs.num_placeholders == 1
    assert inputs.placeholder_index.tolist() == [[6], [3]]


def test_the_steady_decode_batch_needs_no_index() -> None:
    # Request i has 4 known tokens on blocks [i + 1, i + 5]; it decodes the pending fifth.
    requests = {
        str(i): Req([10 * i] * 4, [i + 1, i + 5], num_computed_tokens=4, num_output_placeholders=1)
        for i in range(3)
    }
    # Same requests in the same order as the step before: row i of its tokens is input i.
    inputs = make_buffers().prepare(
        requests, dict.fromkeys(requests, 1), 3, {"0": 0, "1": 1, "2": 2}
    )
    assert inputs.input_ids.tolist() == [0, 0, 0]
    assert inputs.positions.tolist() == [4, 4, 4]
    assert inputs.attn_metadata.slot_mapping[0].tolist() == [20, 24, 28]
    assert inputs.sampled_req_ids == ["0", "1", "2"]
    assert inputs.logits_indices is None  # every token is sampled
    assert (inputs.num_placeholders, inputs.placeholder_index) == (3, None)
    # Reordered, the index says which row of the previous output feeds which input.
    inputs = make_buffers().prepare(
        requests, dict.fromkeys(requests, 1), 3, {"0": 1, "1": 0, "2": 2}
    )
    assert inputs.placeholder_index.tolist() == [[0, 1, 2], [1, 0, 2]]


def test_profile_batch_lays_whole_prompts_on_consecutive_blocks() -> None:
    requests, scheduled = profile_batch([5, 3, 8], BLOCK)
    assert scheduled == {"0": 5, "1": 3, "2": 8}
    assert [(r.block_ids, r.token_ids, r.num_computed_tokens) for r in requests.values()] == [
        (([1, 2],), [0] * 5, 0),
        (([3],), [0] * 3, 0),
        (([4, 5],), [0] * 8, 0),
    ]
    inputs = make_buffers().prepare(requests, scheduled, 16, {})
    assert inputs.attn_metadata.slot_mapping[0].tolist() == [
        4,
        5,
        6,
        7,
        8,
        12,
        13,
        14,
        *range(16, 24),
    ]
    assert inputs.logits_indices.tolist() == [4, 7, 15]


def test_each_kv_cache_group_gets_its_own_tables_and_slots() -> None:
    """Two groups (e.g. full attention and a sliding window whose first block was released)."""
    buffers = InputBuffers(32, 4, MAX_MODEL_LEN, BLOCK, torch.device("cpu"), num_kv_groups=2)
    requests = {
        "chunk": Req(list(range(10)), ([7, 3, 9], [0, 4, 6]), num_computed_tokens=5),
        "decode": Req(list(range(6)), ([5, 6], [1, 2]), num_computed_tokens=5),
    }
    inputs = buffers.prepare(requests, {"chunk": 4, "decode": 1}, 5, {})
    meta = inputs.attn_metadata
    assert [m.tolist() for m in meta.slot_mapping] == [[13, 14, 15, 36, 25], [17, 18, 19, 24, 9]]
    tables = [t.tolist() for t in meta.block_tables]
    assert [tables[0][0], tables[0][1][:2]] == [[7, 3, 9], [5, 6]]
    assert [tables[1][0], tables[1][1][:2]] == [[0, 4, 6], [1, 2]]

    requests, scheduled = profile_batch([5], BLOCK, num_kv_groups=2)
    assert requests["0"].block_ids == ([1, 2], [1, 2])


def test_a_step_with_long_chunks_carries_its_sdpa_segments(monkeypatch) -> None:
    """Built once per step (the layers only read them): the decode, then the fresh prompt and
    the chunk after a short cached prefix that SDPA takes, with each run's longest chunk and
    context; the chunk goes back to the paged kernel where its context is past the plans that
    start-up builds."""
    import ferrum.kernels.sdpa_prefill as sdpa_module

    monkeypatch.setattr(sdpa_module, "SDPA_PREFILL_MIN_TOKENS", 8)
    requests = {
        "decode": Req(list(range(200, 206)), [5, 6], num_computed_tokens=5),
        "fresh": Req(list(range(100, 110)), [7, 3, 9]),
        "chunk": Req(list(range(300, 312)), [1, 2, 4], num_computed_tokens=4),
    }
    scheduled = {"decode": 1, "fresh": 10, "chunk": 8}
    meta = make_buffers().prepare(requests, scheduled, 19, {}).attn_metadata
    assert [
        (s.first, s.last, s.sdpa, s.max_query_len, s.max_seq_len) for s in meta.prefill_segments
    ] == [(0, 1, False, 1, 6), (1, 3, True, 10, 12)]
    # A context past the plans start-up built, or chunks after a prefix turned off (no cuDNN):
    # the chunk goes back to the paged kernel.
    for limits in ({"sdpa_max_len": 11}, {"sdpa_prefix_per_chunk": 0}):
        buffers = make_buffers()
        vars(buffers).update(limits)
        meta = buffers.prepare(requests, scheduled, 19, {}).attn_metadata
        assert [(s.first, s.last, s.sdpa) for s in meta.prefill_segments] == [
            (0, 1, False),
            (1, 2, True),
            (2, 3, False),
        ]
    monkeypatch.setattr(sdpa_module, "SDPA_PREFILL_MIN_TOKENS", 11)
    assert make_buffers().prepare(requests, scheduled, 19, {}).attn_metadata.prefill_segments == ()


def test_flash_attention_steps_are_eager_with_much_prompt_attention(monkeypatch) -> None:
    """The fresh prompt sees 55 (query, key) pairs and the chunk after 4 cached tokens 68, the
    decode none: marked from 123 pairs, never when padded for a CUDA graph nor decode-only, nor
    where no layer took FlashAttention-4."""
    import ferrum.kernels.flash_attn4 as flash_module

    requests = {
        "decode": Req(list(range(200, 206)), [5, 6], num_computed_tokens=5),
        "fresh": Req(list(range(100, 110)), [7, 3, 9]),
        "chunk": Req(list(range(300, 312)), [1, 2, 4], num_computed_tokens=4),
    }
    scheduled = {"decode": 1, "fresh": 10, "chunk": 8}

    def buffers(marks: bool = True) -> InputBuffers:
        made = make_buffers()
        made.marks_flash_attention = marks
        return made

    for limit, marked in ((123, True), (124, False)):
        monkeypatch.setattr(flash_module, "FA4_MIN_PAIRS", limit)
        meta = buffers().prepare(requests, scheduled, 19, {}).attn_metadata
        assert meta.flash_attention_step is marked
    monkeypatch.setattr(flash_module, "FA4_MIN_PAIRS", 1)
    padded = buffers().prepare(requests, scheduled, 19, {}, pad_to=(32, 4)).attn_metadata
    assert not padded.flash_attention_step
    decodes = buffers().prepare(requests, {"decode": 1}, 1, {}).attn_metadata
    assert not decodes.flash_attention_step
    # No layer took FlashAttention-4: no step is marked (nor counted).
    assert (
        not buffers(False).prepare(requests, scheduled, 19, {}).attn_metadata.flash_attention_step
    )
