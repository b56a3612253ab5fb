"""CUDA graph runner, the parts that need no GPU: capture sizes, bucket choice, the padded inputs
a replay reads (laid out by `InputBuffers.prepare(pad_to=...)`), and what a replay returns. Graphs
are stood in for on the CPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from ferrum.model_executor.cuda_graph import PREFILL_SIZES, CUDAGraphRunner, capture_sizes
from ferrum.model_executor.input_batch import InputBuffers, StepInputs

HIDDEN = 3
BLOCK_SIZE = 16


@dataclass
class Req:
    token_ids: list[int]
    block_ids: list[int] | tuple[list[int], ...]
    num_computed_tokens: int
    num_output_placeholders: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.block_ids, list):  # one KV cache group
            self.block_ids = (self.block_ids,)


class FakeGraph:
    def __init__(self) -> None:
        self.num_replays = 0

    def replay(self) -> None:
        self.num_replays += 1


@pytest.fixture
def runner() -> CUDAGraphRunner:
    """Decode batches up to 8 requests, prefill chunks up to 64 tokens, 8 blocks per request."""
    inputs = InputBuffers(64, 8, 8 * BLOCK_SIZE, BLOCK_SIZE, torch.device("cpu"))
    return CUDAGraphRunner(nn.Identity(), inputs, 8, 64, torch.device("cpu"))


def prepare_decode(runner: CUDAGraphRunner, req_ids: list[int]) -> StepInputs:
    """Request i decodes token 100 + i at position i, on blocks [i, i + 50]."""
    requests = {str(i): Req([0] * i + [100 + i], [i, i + 50], i) for i in req_ids}
    scheduled = dict.fromkeys(requests, 1)
    shape = runner.padded_shape(len(req_ids), len(req_ids), 1)
    return runner.inputs.prepare(requests, scheduled, len(req_ids), {}, pad_to=shape)


def prepare_chunk(runner: CUDAGraphRunner, num_tokens: int, num_cached: int) -> StepInputs:
    """One request's chunk of token ids position + 1, on blocks [7, 8, 9]."""
    end = num_cached + num_tokens
    requests = {"r": Req(list(range(1, end + 1)) + [0], [7, 8, 9], num_cached)}
    shape = runner.padded_shape(1, num_tokens, num_tokens)
    return runner.inputs.prepare(requests, {"r": num_tokens}, num_tokens, {}, pad_to=shape)


def read(inputs: StepInputs) -> dict:
    meta = inputs.attn_metadata
    return {
        "input_ids": inputs.input_ids.tolist(),
        "positions": inputs.positions.tolist(),
        "slot_mapping": meta.slot_mapping[0].tolist(),
        "query_start_loc": meta.query_start_loc.tolist(),
        "seq_lens": meta.seq_lens.tolist(),
        "first_blocks": meta.block_tables[0][:, 0].tolist(),
    }


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


def test_buckets_are_the_smallest_captured_size_that_fits(runner: CUDAGraphRunner) -> None:
    assert runner.decode_sizes == [1, 2, 4, 8] and runner.max_batch_size == 8
    assert runner.prefill_sizes == [16, 32, 64] and PREFILL_SIZES[:3] == (16, 32, 64)
    assert [runner.decode_size(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert [runner.prefill_size(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, None]
    # (tokens, requests) of the graph; decode-only batches past the largest bucket and mixed
    # batches run eagerly.
    assert runner.padded_shape(3, 3, 1) == (4, 4) and runner.padded_shape(9, 9, 1) is None
    assert runner.padded_shape(1, 20, 20) == (32, 1) and runner.padded_shape(1, 65, 65) is None
    assert runner.padded_shape(2, 5, 4) is None


def test_verify_graphs_take_batches_of_short_chunks() -> None:
    """Speculative decoding: batches of 1..6 requests of at most 4 tokens (1 + 3 drafts) run
    as B' requests of 4 tokens each, B' the smallest captured batch >= B."""
    inputs = InputBuffers(64, 8, 8 * BLOCK_SIZE, BLOCK_SIZE, torch.device("cpu"))
    runner = CUDAGraphRunner(nn.Identity(), inputs, 8, 64, torch.device("cpu"), None, None, 4, 6)
    assert runner.verify_sizes == [1, 2, 4, 6]
    assert runner.padded_shape(3, 9, 4) == (16, 4) and runner.padded_shape(2, 3, 2) == (8, 2)
    assert runner.padded_shape(3, 9, 5) is None  # a chunk longer than a verify row
    assert runner.padded_shape(7, 10, 2) is None  # more requests than the largest verify batch
    assert runner.padded_shape(1, 4, 4) == (4, 1)
    assert runner.padded_shape(1, 9, 9) == (16, 1)  # a longer chunk: a prefill graph
    requests = {
        "a": Req([1, 2, 3, 4, 5], [1], 1),
        "b": Req([6, 7], [2], 1),
        "c": Req([8, 9, 10], [3], 0),
    }
    scheduled = {"a": 4, "b": 1, "c": 3}
    inputs_step = inputs.prepare(requests, scheduled, 8, {}, pad_to=(16, 4))
    assert inputs_step.attn_metadata.max_query_len == 4
    assert inputs_step.attn_metadata.query_start_loc.tolist() == [0, 4, 5, 8, 9]


def test_a_decode_batch_is_padded_with_one_token_requests_on_slot_zero(
    runner: CUDAGraphRunner,
) -> None:
    for _ in range(2):  # both host buffer sets hold 5 real rows
        assert prepare_decode(runner, [1, 2, 3, 4, 5]).attn_metadata.num_reqs == 8
    inputs = prepare_decode(runner, [6, 7, 8])
    # Row 3 of bucket 4 held a real request in the previous batches: now it is padding.
    assert read(inputs) == {
        "input_ids": [106, 107, 108, 0],
        "positions": [6, 7, 8, 0],
        "slot_mapping": [6 * 16 + 6, 7 * 16 + 7, 8 * 16 + 8, 0],
        "query_start_loc": [0, 1, 2, 3, 4],
        "seq_lens": [7, 8, 9, 1],
        "first_blocks": [6, 7, 8, 0],
    }
    meta = inputs.attn_metadata
    assert meta.block_tables[0].shape == (4, 8) and meta.block_tables[0][:3, 1].tolist() == [
        56,
        57,
        58,
    ]
    assert (meta.max_query_len, meta.max_seq_len) == (1, 8 * BLOCK_SIZE)
    # Every real token is sampled: the replay's hidden states need no gather.
    assert inputs.logits_indices is None and inputs.sampled_req_ids == ["6", "7", "8"]


def test_a_chunk_is_padded_with_tokens_of_no_request(runner: CUDAGraphRunner) -> None:
    for _ in range(2):  # both host buffer sets hold a 20-token chunk
        prepare_chunk(runner, 20, num_cached=0)
    inputs = prepare_chunk(runner, 5, num_cached=11)
    # Tokens 5..15 of the 16-token graph held the previous chunks: now token 0 at slot 0.
    assert read(inputs) == {
        "input_ids": [12, 13, 14, 15, 16] + [0] * 11,
        "positions": [11, 12, 13, 14, 15] + [0] * 11,
        "slot_mapping": [7 * 16 + 11, 7 * 16 + 12, 7 * 16 + 13, 7 * 16 + 14, 7 * 16 + 15]
        + [0] * 11,
        "query_start_loc": [0, 5],
        "seq_lens": [16],
        "first_blocks": [7],
    }
    meta = inputs.attn_metadata
    assert meta.block_tables[0][0, :3].tolist() == [7, 8, 9]
    assert (meta.max_query_len, meta.max_seq_len) == (16, 8 * BLOCK_SIZE)


def test_a_padded_shape_always_gets_the_same_addresses(runner: CUDAGraphRunner) -> None:
    """What a graph captured is what a later step of its shape fills."""
    empty = runner.inputs.prepare({}, {}, 0, {}, pad_to=(4, 4))
    real = prepare_decode(runner, [1, 2, 3])
    assert real.input_ids.data_ptr() != empty.input_ids.data_ptr()  # on the CPU, the other host set
    again = prepare_decode(runner, [4, 5, 6])
    assert again.input_ids.data_ptr() == empty.input_ids.data_ptr()
    for name in ("query_start_loc", "seq_lens"):
        ptr = getattr(again.attn_metadata, name).data_ptr()
        assert ptr == getattr(empty.attn_metadata, name).data_ptr(), name
    for name in ("block_tables", "slot_mapping"):
        ptrs = [t.data_ptr() for t in getattr(again.attn_metadata, name)]
        assert ptrs == [t.data_ptr() for t in getattr(empty.attn_metadata, name)], name


def test_capture_inputs_are_padding_only(runner: CUDAGraphRunner) -> None:
    decode = read(runner.inputs.prepare({}, {}, 0, {}, pad_to=(2, 2)))
    assert decode["query_start_loc"] == [0, 1, 2] and decode["seq_lens"] == [1, 1]
    chunk = read(runner.inputs.prepare({}, {}, 0, {}, pad_to=(16, 1)))
    assert chunk["query_start_loc"] == [0, 1] and chunk["seq_lens"] == [1]
    assert chunk["slot_mapping"] == [0] * 16


def test_replay_returns_the_hidden_states_of_the_real_tokens(runner: CUDAGraphRunner) -> None:
    graph = FakeGraph()
    runner.graphs[(4, 4)] = graph  # type: ignore[assignment]
    runner.outputs[(4, 4)] = torch.arange(4 * HIDDEN).view(4, HIDDEN)
    hidden = runner.replay((4, 4), 3)
    assert graph.num_replays == 1
    assert hidden.tolist() == torch.arange(9).view(3, HIDDEN).tolist()


def test_a_decode_step_without_adapters_replays_the_graph_without_lora(
    runner: CUDAGraphRunner,
) -> None:
    """With LoRA, a decode shape has a graph with the adapters' kernels and one without: a step
    whose batch holds no adapter replays the latter; prefill and verify shapes have only the
    former, which serves any step."""
    from ferrum.lora.layers import LoRABatch

    batch = LoRABatch(8, 2, torch.device("cpu"), is_triton=False)
    runner.lora_batch = batch
    with_lora, without = FakeGraph(), FakeGraph()
    runner.graphs[(4, 4)], runner.base_graphs[(4, 4)] = with_lora, without  # type: ignore[assignment]
    runner.outputs[(4, 4)] = torch.zeros(4, HIDDEN)
    runner.base_outputs[(4, 4)] = torch.ones(4, HIDDEN)
    chunk = FakeGraph()
    runner.graphs[(16, 1)], runner.outputs[(16, 1)] = chunk, torch.zeros(16, HIDDEN)  # type: ignore[assignment]
    batch.active = True
    assert not runner.replay((4, 4), 4).any()  # the output of the graph it replayed
    batch.active = False
    assert runner.replay((4, 4), 4).all()
    runner.replay((16, 1), 3)
    assert (with_lora.num_replays, without.num_replays, chunk.num_replays) == (1, 1, 1)
    with batch.adapters(False):  # what the runner captures the latter under
        assert not batch.active
        with batch.adapters(True):  # and the former
            assert batch.active
    assert not batch.active


def test_lora_adds_the_outputs_of_the_graphs_without_adapters_to_the_memory_estimate() -> None:
    import types

    from ferrum.model_executor.gpu_memory_profile import base_graph_output_bytes

    def runner_with(enable_lora: bool, is_last: bool) -> types.SimpleNamespace:
        config = types.SimpleNamespace(
            lora_config=types.SimpleNamespace(enable_lora=enable_lora),
            scheduler_config=types.SimpleNamespace(max_num_seqs=8),
            model_config=types.SimpleNamespace(
                dtype="bfloat16", arch=types.SimpleNamespace(hidden_size=16)
            ),
        )
        return types.SimpleNamespace(config=config, stage=types.SimpleNamespace(is_last=is_last))

    assert base_graph_output_bytes(runner_with(False, True)) == 0  # type: ignore[arg-type]
    # Decode sizes 1, 2, 4, 8: 15 rows of 16 bf16 values; (hidden, residual) before the last.
    assert base_graph_output_bytes(runner_with(True, True)) == 15 * 16 * 2  # type: ignore[arg-type]
    assert base_graph_output_bytes(runner_with(True, False)) == 2 * 15 * 16 * 2  # type: ignore[arg-type]
