"""CUDA graphs captured once at start-up: decode batches (B requests run as the smallest
captured batch >= B, padded with one-token requests), single-request prompt chunks (L tokens
run as the smallest captured count >= L, padded with tokens of no request, which no op mixes
with real rows) and, with speculative decoding, verify batches (B requests of at most q = 1 +
num_speculative_tokens tokens each run as the smallest captured B' >= B with B' * q tokens).
A graph reads the runner's `InputBuffers` where a batch padded to its shape (`padded_shape`)
lies. A pipeline stage's graphs cover its layers: after the first stage they read the previous
one's activations from `stage_input(tokens)`; before the last they return (hidden, residual)
of every padded token. With LoRA adapters the graphs run the adapters' kernels (any mix of
slots); decode batches also get a graph without them, replayed for a step that has none."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.logger import init_logger
from ferrum.model_executor.input_batch import InputBuffers

if TYPE_CHECKING:
    from ferrum.lora.layers import LoRABatch

logger = init_logger(__name__)

PREFILL_SIZES = (16, 32, 64, 128, 256, 512)
# The largest decode batch a graph is captured for (larger batches run eagerly).
MAX_GRAPH_BATCH_SIZE = 512


def max_graph_batch_size(max_num_seqs: int) -> int:
    return min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to max_batch_size (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


def _smallest_at_least(sizes: list[int], n: int) -> int | None:
    return next((s for s in sizes if s >= n), None)


class CUDAGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        inputs: InputBuffers,
        max_batch_size: int,
        max_prefill_tokens: int,
        device: torch.device,
        stage_input_size: int | None = None,
        stage_input_dtype: torch.dtype | None = None,
        verify_query_len: int = 1,
        max_verify_batch_size: int = 0,
        lora_batch: LoRABatch | None = None,
    ) -> None:
        """`stage_input_size`: the hidden size of the activations a pipeline stage after the
        first receives (None on the first stage). `verify_query_len` > 1: verify graphs for
        batches of 1 to `max_verify_batch_size` requests. `lora_batch`: the model's LoRA layers'
        step state (decode graphs without adapters too)."""
        self.model = model
        self.inputs = inputs
        self.device = device
        self.decode_sizes = capture_sizes(max_batch_size)
        self.prefill_sizes = [s for s in PREFILL_SIZES if s <= max_prefill_tokens]
        self.verify_query_len = verify_query_len
        self.verify_sizes = (
            capture_sizes(max_verify_batch_size)
            if verify_query_len > 1 and max_verify_batch_size > 0
            else []
        )
        # Keyed by padded shape: (tokens, requests).
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        # Decode graphs without the LoRA layers' adapter kernels (LoRA only), by shape.
        self.lora_batch = lora_batch
        self.base_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.base_outputs: dict[
            tuple[int, int], torch.Tensor | tuple[torch.Tensor, torch.Tensor]
        ] = {}
        # The received (hidden, residual) of up to the largest graph's tokens, flat so that
        # every token count's [2, tokens, hidden] view is contiguous.
        self._hidden_size = stage_input_size
        self._stage_input: torch.Tensor | None = None
        if stage_input_size is not None:
            max_tokens = max(
                self.decode_sizes
                + self.prefill_sizes
                + [s * verify_query_len for s in self.verify_sizes]
            )
            self._stage_input = torch.zeros(
                2 * max_tokens * stage_input_size, dtype=stage_input_dtype, device=device
            )

    @property
    def max_batch_size(self) -> int:
        return self.decode_sizes[-1]

    def decode_size(self, num_reqs: int) -> int | None:
        return _smallest_at_least(self.decode_sizes, num_reqs)

    def prefill_size(self, num_tokens: int) -> int | None:
        return _smallest_at_least(self.prefill_sizes, num_tokens)

    def stage_input(self, num_tokens: int) -> torch.Tensor:
        """The [2, num_tokens, hidden] buffer the graphs of `num_tokens` padded tokens read the
        previous stage's (hidden, residual) from."""
        assert self._stage_input is not None and self._hidden_size is not None
        size = 2 * num_tokens * self._hidden_size
        return self._stage_input[:size].view(2, num_tokens, self._hidden_size)

    def padded_shape(
        self, num_reqs: int, num_tokens: int, max_query_len: int
    ) -> tuple[int, int] | None:
        """(tokens, requests) of the graph that runs this batch, or None: it runs eagerly."""
        if num_tokens == num_reqs:
            size = self.decode_size(num_reqs)
            return None if size is None else (size, size)
        q = self.verify_query_len
        size = _smallest_at_least(self.verify_sizes, num_reqs) if max_query_len <= q else None
        if size is not None:
            return size * q, size
        size = self.prefill_size(num_tokens) if num_reqs == 1 else None
        return None if size is None else (size, 1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every graph, largest first within each kind, into one memory pool."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        shapes = [(s, 1) for s in reversed(self.prefill_sizes)]
        decode_shapes = [(s, s) for s in reversed(self.decode_sizes)]
        shapes += decode_shapes
        shapes += [(s * self.verify_query_len, s) for s in reversed(self.verify_sizes)]
        lora = self.lora_batch
        with contextlib.nullcontext() if lora is None else lora.adapters(True):
            for shape in shapes:
                self.graphs[shape], self.outputs[shape] = self._capture_one(shape, pool, stream)
        if lora is not None:
            with lora.adapters(False):
                for shape in decode_shapes:
                    graph, output = self._capture_one(shape, pool, stream)
                    self.base_graphs[shape], self.base_outputs[shape] = graph, output
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs (decode batch sizes 1..%d, single-request prefill chunks of "
            "up to %d tokens, verify batches of up to %d requests; %d decode graphs without "
            "LoRA adapters) in %.2f s",
            len(self.graphs) + len(self.base_graphs),
            self.max_batch_size,
            self.prefill_sizes[-1] if self.prefill_sizes else 0,
            self.verify_sizes[-1] if self.verify_sizes else 0,
            len(self.base_graphs),
            time.perf_counter() - start,
        )

    def _capture_one(
        self, shape: tuple[int, int], pool: tuple[int, int], stream: torch.cuda.Stream
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        # Padding only: one-token requests (a one-token chunk for the prefill graphs).
        inputs = self.inputs.prepare({}, {}, 0, {}, pad_to=shape)
        intermediate = None
        if self._stage_input is not None:
            received = self.stage_input(shape[0])
            intermediate = (received[0], received[1])
        args = (inputs.input_ids, inputs.positions, inputs.attn_metadata, intermediate)
        # The side stream must see the inputs (and KV cache) that the current stream filled.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the kernels and settles the allocator
                self.model(*args)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            output = self.model(*args)
        return graph, output

    def replay(
        self, shape: tuple[int, int], num_tokens: int
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Runs the graph of `shape` on inputs prepared with `pad_to=shape`; returns the hidden
        states of the first `num_tokens` (the real) tokens, or on a pipeline stage before the
        last its (hidden, residual) of every padded token. A decode step without LoRA adapters
        replays its graph without them."""
        graphs, outputs = self.graphs, self.outputs
        if self.lora_batch is not None and not self.lora_batch.active and shape in self.base_graphs:
            graphs, outputs = self.base_graphs, self.base_outputs  # a step without adapters
        graphs[shape].replay()
        output = outputs[shape]
        if isinstance(output, tuple):
            return output
        return output[:num_tokens]
