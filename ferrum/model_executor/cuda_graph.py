"""CUDA graphs captured once at start-up: decode batches and single-request prompt chunks.

- Decode: a batch of B requests with one token each runs as the graph of the smallest captured
  batch size >= B. Rows past B are padding requests: one token at position 0 whose KV goes to
  slot 0 (block 0 is never handed out), attending over that one slot.
- Prefill: one request's chunk of L tokens (over any cached prefix) runs as the graph of the
  smallest captured token count >= L. Tokens past L belong to no request: their KV goes to slot 0
  and attention leaves their rows unwritten; no op mixes rows, so they never touch real tokens.

The graphs read static input buffers owned by this object, filled by two host->device copies
from pinned host buffers. The host can run ahead of the device (async scheduling, or prompt chunks
that sample nothing and so are never waited for), so the host buffers alternate between two sets
and a set is rewritten only once the event recorded after its last copies has fired.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ferrum.logger import init_logger
from ferrum.model_executor.attention_metadata import AttentionMetadata

logger = init_logger(__name__)

PREFILL_SIZES = (16, 32, 64, 128, 256, 512)
# int32 slots before seq_lens in the int buffer: the prefill query_start_loc, padded to 16 bytes.
_HEADER = 4


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
        max_batch_size: int,
        max_prefill_tokens: int,
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
        split_kv_workspace: object,
    ) -> None:
        self.model = model
        self.device = device
        self.max_model_len = max_model_len
        self.split_kv_workspace = split_kv_workspace
        self.decode_sizes = capture_sizes(max_batch_size)
        self.prefill_sizes = [s for s in PREFILL_SIZES if s <= max_prefill_tokens]
        n = max(max_batch_size, *self.prefill_sizes) if self.prefill_sizes else max_batch_size
        width = max_blocks_per_req
        self._num_rows = max_batch_size
        # int64 [input_ids, positions, slot_mapping] x n tokens, and int32 [query_start_loc of the
        # prefill graphs (2, padded to 4 for alignment) | seq_lens (rows) | block_tables].
        self._tokens = torch.zeros(3, n, dtype=torch.int64, device=device)
        self._tokens_host = [torch.zeros(3, n, dtype=torch.int64).pin_memory() for _ in range(2)]
        rows = max_batch_size
        size = _HEADER + rows * (1 + width)
        self._ints = torch.zeros(size, dtype=torch.int32, device=device)
        self._ints_host = [torch.zeros(size, dtype=torch.int32).pin_memory() for _ in range(2)]
        self._num_runs = 0
        # Recorded after each set's copies: the set may be rewritten once it has fired.
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self.input_ids, self.positions, self.slot_mapping = self._tokens
        self.prefill_query_start_loc = self._ints[:2]
        self.seq_lens = self._ints[_HEADER : _HEADER + rows]
        self.block_tables = self._ints[_HEADER + rows :].view(rows, width)
        self.seq_lens.fill_(1)
        self.decode_query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.decode_sizes[-1]

    def decode_size(self, num_reqs: int) -> int | None:
        return _smallest_at_least(self.decode_sizes, num_reqs)

    def prefill_size(self, num_tokens: int) -> int | None:
        return _smallest_at_least(self.prefill_sizes, num_tokens)

    def _metadata(self, kind: str, size: int) -> AttentionMetadata:
        decode = kind == "decode"
        num_reqs = size if decode else 1
        return AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=size,
            max_query_len=1 if decode else size,
            max_seq_len=self.max_model_len,
            query_start_loc=(
                self.decode_query_start_loc[: size + 1] if decode else self.prefill_query_start_loc
            ),
            seq_lens=self.seq_lens[:num_reqs],
            block_tables=self.block_tables[:num_reqs],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            split_kv_workspace=self.split_kv_workspace,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every graph, largest first within each kind, into one memory pool."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        # The side stream must see the buffers (and KV cache) that the current stream filled.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # A prefill graph's one request: a one-token chunk until real inputs arrive.
        self.prefill_query_start_loc.copy_(torch.tensor([0, 1], dtype=torch.int32))
        keys = [("prefill", s) for s in reversed(self.prefill_sizes)]
        keys += [("decode", s) for s in reversed(self.decode_sizes)]
        for key in keys:
            kind, size = key
            args = (self.input_ids[:size], self.positions[:size], self._metadata(kind, size))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the kernels and settles the allocator
                    self.model(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[key] = self.model(*args)
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs (decode batch sizes 1..%d, single-request prefill chunks of "
            "up to %d tokens) in %.2f s",
            len(self.graphs),
            self.max_batch_size,
            self.prefill_sizes[-1] if self.prefill_sizes else 0,
            time.perf_counter() - start,
        )

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        fill_input_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Replays a graph for a decode-only batch (one token per row of seq_lens) or for one
        request's chunk (len(seq_lens) == 1); returns the hidden states of the real tokens.
        `fill_input_ids` may write device-side tokens into the input ids before the replay."""
        num_tokens, num_reqs = len(input_ids), len(seq_lens)
        decode = num_tokens == num_reqs
        size = self.decode_size(num_reqs) if decode else self.prefill_size(num_tokens)
        assert size is not None and (decode or num_reqs == 1)
        rows = self._num_rows
        width = self.block_tables.shape[1]
        buffer_set = self._num_runs % 2
        self._num_runs += 1
        tokens_host, ints_host = self._tokens_host[buffer_set], self._ints_host[buffer_set]
        copied = self._copied[buffer_set]
        if copied is not None:
            copied.synchronize()  # the run two back: its copies are normally long done
        tokens = tokens_host.numpy()
        tokens[0, :num_tokens] = input_ids
        tokens[1, :num_tokens] = positions
        tokens[2, :num_tokens] = slot_mapping
        tokens[:, num_tokens:size] = 0  # padding: token 0 at position 0, KV into slot 0
        ints = ints_host.numpy()
        ints[:2] = (0, num_tokens)
        ints[_HEADER : _HEADER + num_reqs] = seq_lens
        num_rows = size if decode else 1
        ints[_HEADER + num_reqs : _HEADER + num_rows] = 1  # padding requests: one-token context
        # Entries past a row's context are never read, so stale ones need no clearing.
        tables = ints[_HEADER + rows :].reshape(rows, width)
        tables[:num_reqs, : block_tables.shape[1]] = block_tables
        tables[num_reqs:num_rows, 0] = 0
        used = _HEADER + rows + num_rows * width
        self._tokens.copy_(tokens_host, non_blocking=True)
        self._ints[:used].copy_(ints_host[:used], non_blocking=True)
        copied = self._copied[buffer_set] = torch.cuda.Event()
        copied.record()
        if fill_input_ids is not None:
            fill_input_ids(self.input_ids[:num_tokens])
        key = ("decode" if decode else "prefill", size)
        self.graphs[key].replay()
        return self.outputs[key][:num_tokens]
