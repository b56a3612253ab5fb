"""CUDA graph runner, the parts that need no GPU: capture sizes, bucket choice, and the padded
inputs a replay reads. Pinned memory, events and graphs are stood in for on the CPU; the graph
stand-in records what its input buffers hold at replay, which is what a real graph would read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ferrum.model_executor.cuda_graph import PREFILL_SIZES, CUDAGraphRunner, capture_sizes

HIDDEN = 3


class FakeEvent:
    created: list[FakeEvent] = []

    def __init__(self) -> None:
        self.waited = False
        FakeEvent.created.append(self)

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        self.waited = True


class FakeGraph:
    """Records, at each replay, the inputs of its batch size as the graph would read them."""

    def __init__(self, runner: CUDAGraphRunner, kind: str, size: int, replays: list) -> None:
        self.runner, self.kind, self.size, self.replays = runner, kind, size, replays

    def replay(self) -> None:
        r, size = self.runner, self.size
        decode = self.kind == "decode"
        rows = size if decode else 1
        replay = {
            "graph": (self.kind, size),
            "input_ids": r.input_ids[:size].tolist(),
            "positions": r.positions[:size].tolist(),
            "slot_mapping": r.slot_mapping[:size].tolist(),
            "seq_lens": r.seq_lens[:rows].tolist(),
            "first_blocks": r.block_tables[:rows, 0].tolist(),
        }
        if not decode:
            replay["query_start_loc"] = r.prefill_query_start_loc.tolist()
        self.replays.append(replay)


@pytest.fixture
def graphs(monkeypatch: pytest.MonkeyPatch) -> tuple[CUDAGraphRunner, list[dict]]:
    """Decode batches up to 8 requests, prefill chunks up to 64 tokens, 8 blocks per request."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(FakeEvent, "created", [])
    runner = CUDAGraphRunner(
        nn.Identity(),
        max_batch_size=8,
        max_prefill_tokens=64,
        max_blocks_per_req=8,
        max_model_len=32,
        device=torch.device("cpu"),
        split_kv_workspace=None,
    )
    replays: list[dict] = []
    for kind, sizes in (("decode", runner.decode_sizes), ("prefill", runner.prefill_sizes)):
        for size in sizes:
            runner.graphs[(kind, size)] = FakeGraph(runner, kind, size, replays)
            runner.outputs[(kind, size)] = torch.arange(size * HIDDEN).view(size, HIDDEN)
    return runner, replays


def run_decode(runner: CUDAGraphRunner, req_ids: list[int]) -> torch.Tensor:
    """A decode batch: request i has token 100 + i at position i, slot 10 * i, block i."""
    n = len(req_ids)
    ids = np.array(req_ids, dtype=np.int64)
    tables = np.array([[i, i + 50] for i in req_ids], dtype=np.int32)
    return runner.run(100 + ids, ids, 10 * ids, (ids + 1).astype(np.int32), tables.reshape(n, 2))


def run_prefill(runner: CUDAGraphRunner, num_tokens: int, num_cached: int) -> torch.Tensor:
    positions = np.arange(num_cached, num_cached + num_tokens, dtype=np.int64)
    seq_lens = np.array([num_cached + num_tokens], dtype=np.int32)
    tables = np.array([[7, 8, 9]], dtype=np.int32)
    return runner.run(positions + 1, positions, positions + 40, seq_lens, tables)


@pytest.mark.parametrize(
    ("max_batch_size", "sizes"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (20, [1, 2, 4, 8, 16, 20]),
        (24, [1, 2, 4, 8, 16, 24]),
    ],
)
def test_capture_sizes(max_batch_size: int, sizes: list[int]) -> None:
    assert capture_sizes(max_batch_size) == sizes


def test_buckets_are_the_smallest_captured_size_that_fits(graphs) -> None:
    runner, _ = graphs
    assert runner.decode_sizes == [1, 2, 4, 8] and runner.max_batch_size == 8
    assert runner.prefill_sizes == [16, 32, 64] and PREFILL_SIZES[:3] == (16, 32, 64)
    assert [runner.decode_size(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert [runner.prefill_size(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, None]


def test_a_decode_batch_is_padded_with_one_token_requests_on_slot_zero(graphs) -> None:
    runner, replays = graphs
    for _ in range(2):  # both host buffer sets hold 5 real rows
        run_decode(runner, [1, 2, 3, 4, 5])
    hidden = run_decode(runner, [6, 7, 8])
    # Row 3 of bucket 4 held a real request in the previous batches: now it is padding.
    assert replays[-1] == {
        "graph": ("decode", 4),
        "input_ids": [106, 107, 108, 0],
        "positions": [6, 7, 8, 0],
        "slot_mapping": [60, 70, 80, 0],
        "seq_lens": [7, 8, 9, 1],
        "first_blocks": [6, 7, 8, 0],
    }
    assert replays[0]["graph"] == ("decode", 8)
    assert runner.block_tables[:3, :2].tolist() == [[6, 56], [7, 57], [8, 58]]
    # The hidden states of the real rows only.
    assert hidden.tolist() == torch.arange(9).view(3, HIDDEN).tolist()


def test_a_chunk_is_padded_with_tokens_of_no_request(graphs) -> None:
    runner, replays = graphs
    for _ in range(2):  # both host buffer sets hold a 20-token chunk
        run_prefill(runner, 20, num_cached=0)
    hidden = run_prefill(runner, 5, num_cached=11)
    assert replays[0]["graph"] == ("prefill", 32)
    # Tokens 5..15 of the 16-token graph held the previous chunks: now token 0 at slot 0.
    assert replays[2] == {
        "graph": ("prefill", 16),
        "input_ids": [12, 13, 14, 15, 16] + [0] * 11,
        "positions": [11, 12, 13, 14, 15] + [0] * 11,
        "slot_mapping": [51, 52, 53, 54, 55] + [0] * 11,
        "seq_lens": [16],
        "first_blocks": [7],
        "query_start_loc": [0, 5],
    }
    assert runner.block_tables[0, :3].tolist() == [7, 8, 9]
    assert hidden.shape == (5, HIDDEN)


def test_host_buffers_alternate_and_wait_for_the_copies_two_runs_back(graphs) -> None:
    runner, _ = graphs
    run_decode(runner, [1])
    run_decode(runner, [2])
    first, second = FakeEvent.created  # one event recorded after each run's copies
    assert not first.waited and not second.waited
    run_decode(runner, [3])  # rewrites the first run's host buffers: waits for its copies
    assert first.waited and not second.waited
    run_decode(runner, [4])
    assert second.waited and not FakeEvent.created[2].waited


def test_fill_input_ids_writes_device_tokens_before_the_replay(graphs) -> None:
    runner, replays = graphs

    def fill(input_ids: torch.Tensor) -> None:
        assert input_ids.shape == (2,)
        input_ids[1] = 999

    ids = np.array([1, 2], dtype=np.int64)
    tables = np.zeros((2, 1), dtype=np.int32)
    runner.run(ids, ids, ids, np.array([2, 3], dtype=np.int32), tables, fill_input_ids=fill)
    assert replays[-1]["input_ids"] == [1, 999]
