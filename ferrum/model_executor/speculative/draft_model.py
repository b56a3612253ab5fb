"""A small model of the target's vocabulary proposes drafts (`method: draft_model`). Its KV
cache has one block per block of the target's full-attention group and shares that group's
block tables, so it needs no block pool of its own. Each step it runs on the target's own step
inputs right after the target (`follow`: its KV then holds every token the target computed,
drafts included), and once the step's tokens are known it decodes greedily `k` tokens past each
request's last one (`propose`), in the lookahead slots the scheduler allocated for them. Its
CUDA graphs read the target's input buffers: the same shapes at the same addresses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferrum.config import EngineConfig, ModelConfig
from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.model_executor.cuda_graph import CUDAGraphRunner
from ferrum.model_executor.input_batch import InputBuffers, StepInputs
from ferrum.model_executor.kv_cache_sizing import allocate_kv_caches, kv_bytes_per_block
from ferrum.model_executor.model_loader import load_model
from ferrum.model_executor.pipeline_stage import pipeline_stage
from ferrum.model_executor.runner_state import CachedRequestState


@dataclass(slots=True)
class _Lookahead:
    """A request as `InputBuffers.prepare` sees it at draft step i: its known tokens, then i
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


class DraftModel:
    def __init__(
        self,
        config: EngineConfig,
        draft_config: ModelConfig,
        kv_group: int,
        kernel_backend: str,
        device: torch.device,
    ) -> None:
        """`kv_group`: the target's full-attention group, whose tables the draft reads."""
        self.config = draft_config
        self.kv_group = kv_group
        self.device = device
        num_layers = draft_config.arch.num_hidden_layers
        self.model = load_model(
            draft_config,
            device,
            kernel_backend,
            TensorParallelGroup(),
            False,
            pipeline_stage(num_layers, 0, 1),
            config.device_config.batch_invariant,
        )
        self.num_layers = num_layers
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        # Split-KV decode where the target has it: the Triton kernels on CUDA, not batch-invariant.
        self.split_kv = (
            device.type == "cuda"
            and kernel_backend == "triton"
            and not config.device_config.batch_invariant
        )
        self.graphs: CUDAGraphRunner | None = None

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.config, block_size, dtype)

    def bind_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        """Allocates the draft's cache (`num_blocks` = the target group's) and binds it."""
        caches = allocate_kv_caches(self.config, num_blocks, block_size, dtype, self.device)
        workspace = None
        if self.split_kv:
            from ferrum.kernels.split_kv_plan import allocate_split_kv_workspace  # imports Triton

            workspace = allocate_split_kv_workspace(
                min(self.max_num_seqs, 512),
                self.config.arch.num_attention_heads,
                self.config.head_dim,
                self.device,
            )
        self.model.bind_kv_caches(caches, workspace, [self.kv_group] * self.num_layers)

    def release_kv_cache(self) -> None:
        self.model.bind_kv_caches([])

    def capture_graphs(self, target_graphs: CUDAGraphRunner) -> None:
        """Graphs of the target's shapes over the target's input buffers."""
        graphs = CUDAGraphRunner(
            self.model,
            target_graphs.inputs,
            max_batch_size=target_graphs.max_batch_size,
            max_prefill_tokens=target_graphs.prefill_sizes[-1]
            if target_graphs.prefill_sizes
            else 0,
            device=self.device,
            verify_query_len=target_graphs.verify_query_len,
            max_verify_batch_size=target_graphs.verify_sizes[-1]
            if target_graphs.verify_sizes
            else 0,
        )
        graphs.capture()
        self.graphs = graphs

    def _forward(
        self, inputs: StepInputs, shape: tuple[int, int] | None, num_tokens: int
    ) -> torch.Tensor:
        if shape is None or self.graphs is None:
            ids, positions = inputs.input_ids[:num_tokens], inputs.positions[:num_tokens]
            return self.model(ids, positions, inputs.attn_metadata)
        hidden = self.graphs.replay(shape, num_tokens)
        assert isinstance(hidden, torch.Tensor)
        return hidden

    def follow(self, inputs: StepInputs, shape: tuple[int, int] | None, num_tokens: int) -> None:
        """Computes the draft's KV of the target's step (the same inputs, as eager or graph)."""
        self._forward(inputs, shape, num_tokens)

    def propose(
        self,
        inputs: InputBuffers,
        states: Sequence[CachedRequestState],
        max_drafts: Sequence[int],
        block_size: int,
    ) -> dict[str, list[int]]:
        """Greedy drafts past each request's last token, at most max_drafts[i] for states[i]
        (and no more than its allocated slots hold). One host sync, at the end."""
        rows = []
        for state, limit in zip(states, max_drafts):
            position = len(state.token_ids) - 1
            room = len(state.block_ids[self.kv_group]) * block_size - position
            if min(limit, room) > 0:
                rows.append((state, position, min(limit, room)))
        if not rows:
            return {}
        # Most drafts first: the rows still decoding at each step are a prefix.
        rows.sort(key=lambda row: -row[2])
        k = rows[0][2]
        drafts = torch.zeros((len(rows), k), dtype=torch.int64, device=self.device)
        previous = None
        for step in range(k):
            active = [row for row in rows if row[2] > step]
            n = len(active)
            requests = {
                state.req_id: _Lookahead(
                    state.token_ids[-1], position + 1, state.block_ids, position + step
                )
                for state, position, _ in active
            }
            graphs = self.graphs
            shape = None if graphs is None else graphs.padded_shape(n, n, 1)
            step_inputs = inputs.prepare(requests, dict.fromkeys(requests, 1), n, {}, shape)
            if previous is not None:
                step_inputs.input_ids[:n].copy_(previous[:n])
            hidden = self._forward(step_inputs, shape, n)
            previous = self.model.compute_logits(hidden[:n]).argmax(dim=-1)
            drafts[:n, step] = previous
        host = drafts.tolist()
        return {state.req_id: host[i][:n] for i, (state, _, n) in enumerate(rows)}
