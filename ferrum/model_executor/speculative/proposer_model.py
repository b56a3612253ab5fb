"""What a model that proposes drafts beside the target needs (a draft model, an EAGLE-3 head):
its own paged KV cache, one block per block of the target's full-attention group, read through
that group's block tables (so it needs no block pool of its own); CUDA graphs of the target's
shapes over the target's input buffers; and the greedy decode steps past each request's known
tokens, in the lookahead slots the scheduler allocated for them (`lookahead_rows`,
`prepare_lookahead`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ferrum.config import EngineConfig
from ferrum.model_executor.cuda_graph import CUDAGraphRunner
from ferrum.model_executor.input_batch import InputBuffers, StepInputs
from ferrum.model_executor.runner_state import CachedRequestState

# (request, its last known token's position, the most drafts it gets).
LookaheadRow = tuple[CachedRequestState, int, int]


@dataclass(frozen=True)
class KVShape:
    """The proposer's attention layers: all full attention, unsharded."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class ProposerModel:
    def __init__(
        self,
        model: nn.Module,
        kv_shape: KVShape,
        config: EngineConfig,
        kv_group: int,
        kernel_backend: str,
        device: torch.device,
    ) -> None:
        """`model.bind_kv_caches(caches, workspace, groups)` binds its layers' caches;
        `kv_group`: the target's full-attention group, whose tables it reads."""
        self.model = model
        self.kv_shape = kv_shape
        self.kv_group = kv_group
        self.device = device
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        # Split-KV decode where the target has it: the Triton kernels on CUDA, not batch-invariant.
        self.split_kv = (
            device.type == "cuda"
            and kernel_backend == "triton"
            and not config.device_config.batch_invariant
        )

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        shape, element_size = self.kv_shape, torch.empty((), dtype=dtype).element_size()
        per_layer = 2 * block_size * shape.num_kv_heads * shape.head_dim * element_size
        return shape.num_layers * per_layer

    def bind_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        """Allocates the cache (`num_blocks` = the target group's) and binds it."""
        shape = self.kv_shape
        caches = [
            torch.zeros(
                (2, num_blocks, block_size, shape.num_kv_heads, shape.head_dim),
                dtype=dtype,
                device=self.device,
            )
            for _ in range(shape.num_layers)
        ]
        workspace = None
        if self.split_kv:
            from ferrum.kernels.split_kv_plan import allocate_split_kv_workspace  # imports Triton

            workspace = allocate_split_kv_workspace(
                min(self.max_num_seqs, 512), shape.num_heads, shape.head_dim, self.device
            )
        self.model.bind_kv_caches(caches, workspace, [self.kv_group] * shape.num_layers)

    def release_kv_cache(self) -> None:
        self.model.bind_kv_caches([])

    def capture_like(
        self, module: nn.Module, target_graphs: CUDAGraphRunner, decode_only: bool = False
    ) -> CUDAGraphRunner:
        """Graphs of `module(input_ids, positions, attn_metadata, None)` for the target's
        shapes (only its decode batches with `decode_only`) over the target's input buffers."""
        prefill, verify = target_graphs.prefill_sizes, target_graphs.verify_sizes
        graphs = CUDAGraphRunner(
            module,
            target_graphs.inputs,
            max_batch_size=target_graphs.max_batch_size,
            max_prefill_tokens=prefill[-1] if prefill and not decode_only else 0,
            device=self.device,
            verify_query_len=target_graphs.verify_query_len,
            max_verify_batch_size=verify[-1] if verify and not decode_only else 0,
        )
        graphs.capture()
        return graphs

    @staticmethod
    def run(
        module: nn.Module,
        graphs: CUDAGraphRunner | None,
        inputs: StepInputs,
        shape: tuple[int, int] | None,
        num_tokens: int,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """`module` on a step's inputs, eager or as the graph of `shape` (a tuple output comes
        back whole: every padded token)."""
        if shape is None or graphs is None:
            ids, positions = inputs.input_ids[:num_tokens], inputs.positions[:num_tokens]
            return module(ids, positions, inputs.attn_metadata)
        return graphs.replay(shape, num_tokens)

    def lookahead_rows(
        self,
        states: Sequence[CachedRequestState],
        max_drafts: Sequence[int],
        block_size: int,
        drafts_past_slots: int,
    ) -> list[LookaheadRow]:
        """The requests that get drafts, most drafts first (the rows still decoding at each
        step are a prefix): at most max_drafts[i] for states[i], and no more than its allocated
        slots past its last known token hold plus `drafts_past_slots` (drafts whose KV the
        proposer never writes)."""
        rows = []
        for state, limit in zip(states, max_drafts):
            position = len(state.token_ids) - 1
            room = len(state.block_ids[self.kv_group]) * block_size - position
            n = min(limit, room + drafts_past_slots)
            if n > 0:
                rows.append((state, position, n))
        rows.sort(key=lambda row: -row[2])
        return rows

    @staticmethod
    def prepare_lookahead(
        inputs: InputBuffers,
        rows: Sequence[LookaheadRow],
        position_offset: int,
        graphs: CUDAGraphRunner | None,
    ) -> tuple[StepInputs, tuple[int, int] | None]:
        """One token per row at its last known position + `position_offset`, input id 0 except
        at offset 0 (the last known token): the caller copies the previous step's drafts in."""
        requests = {
            state.req_id: _Lookahead(
                state.token_ids[-1], position + 1, state.block_ids, position + position_offset
            )
            for state, position, _ in rows
        }
        n = len(requests)
        shape = None if graphs is None else graphs.padded_shape(n, n, 1)
        return inputs.prepare(requests, dict.fromkeys(requests, 1), n, {}, shape), shape


@dataclass(slots=True)
class _Lookahead:
    """A request as `InputBuffers.prepare` sees it at a draft step: its known tokens, then
    drafts whose ids the previous draft step left on the device (0 here)."""

    last_token: int
    num_known: int
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    num_output_placeholders: int = 0

    @property
    def token_ids(self) -> _Tokens:
        return _Tokens(self.last_token, self.num_computed_tokens + 1, self.num_known)


@dataclass(slots=True)
class _Tokens:
    last_token: int
    length: int
    num_known: int

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return self.last_token if index == self.num_known - 1 else 0
