"""CUDA graphs for decode steps: one graph per padded batch size, captured once at start-up.

A decode-only batch of B requests (one token each) runs as the graph of the smallest captured
size >= B. The graphs read static input buffers owned by this object; rows past B are padding
that writes its KV to slot 0 (block 0 is never handed out) and attends over that one slot.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from ferrum.logger import init_logger
from ferrum.model_executor.attention_metadata import AttentionMetadata

logger = init_logger(__name__)


def capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to max_batch_size (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


class CUDAGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        max_batch_size: int,
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
        split_kv_workspace: object,
    ) -> None:
        self.model = model
        self.device = device
        self.max_model_len = max_model_len
        self.split_kv_workspace = split_kv_workspace
        self.sizes = capture_sizes(max_batch_size)
        n, width = max_batch_size, max_blocks_per_req
        # Two device buffers, each filled by one host->device copy per step: int64 rows
        # [input_ids, positions, slot_mapping] and int32 [seq_lens (n), block_tables (n x width)].
        self._tokens = torch.zeros(3, n, dtype=torch.int64, device=device)
        self._lens_tables = torch.zeros(n * (1 + width), dtype=torch.int32, device=device)
        self._tokens_host = torch.zeros(3, n, dtype=torch.int64).pin_memory()
        self._lens_tables_host = torch.zeros(n * (1 + width), dtype=torch.int32).pin_memory()
        self.input_ids, self.positions, self.slot_mapping = self._tokens
        self.seq_lens = self._lens_tables[:n]
        self.block_tables = self._lens_tables[n:].view(n, width)
        self.seq_lens.fill_(1)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, batch_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=batch_size,
            num_tokens=batch_size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc_cpu=[],
            seq_lens_cpu=[],
            split_kv_workspace=self.split_kv_workspace,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every size, largest first, into one memory pool."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        # The side stream must see the buffers (and KV cache) that the current stream filled.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for size in reversed(self.sizes):
            metadata = self._metadata(size)
            args = (self.input_ids[:size], self.positions[:size], metadata)
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles the kernels and settles the allocator
                    self.model(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[size] = self.model(*args)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs (decode batch sizes 1..%d) in %.2f s",
            len(self.sizes),
            self.max_batch_size,
            time.perf_counter() - start,
        )

    def padded_size(self, num_reqs: int) -> int | None:
        for size in self.sizes:
            if size >= num_reqs:
                return size
        return None

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> torch.Tensor:
        """Replays the graph for len(input_ids) decode tokens; returns their hidden states."""
        num_reqs = len(input_ids)
        size = self.padded_size(num_reqs)
        assert size is not None
        n, width = self.block_tables.shape
        tokens = self._tokens_host.numpy()
        tokens[0, :num_reqs] = input_ids
        tokens[1, :num_reqs] = positions
        tokens[2, :num_reqs] = slot_mapping
        # Padding rows: token 0 at position 0, KV into slot 0, a one-token context on block 0.
        tokens[:, num_reqs:size] = 0
        lens_tables = self._lens_tables_host.numpy()
        lens = lens_tables[:n]
        lens[:num_reqs] = seq_lens
        lens[num_reqs:size] = 1
        # Entries past a row's context are never read, so stale ones need no clearing.
        tables = lens_tables[n:].reshape(n, width)
        tables[:num_reqs, : block_tables.shape[1]] = block_tables
        tables[num_reqs:size, 0] = 0
        used = n + size * width
        self._tokens.copy_(self._tokens_host, non_blocking=True)
        self._lens_tables[:used].copy_(self._lens_tables_host[:used], non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:num_reqs]
