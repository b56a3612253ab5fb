"""A small model of the target's vocabulary proposes drafts (`method: draft_model`). Its KV
cache and graphs are a `ProposerModel`'s. Each step it runs on the target's own step inputs
right after the target (`follow`: its KV then holds every token the target computed, drafts
included), and once the step's tokens are known it decodes greedily `k` tokens past each
request's last one (`propose`), in the lookahead slots the scheduler allocated for them."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferrum.config import EngineConfig, ModelConfig
from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.model_executor.cuda_graph import CUDAGraphRunner
from ferrum.model_executor.input_batch import InputBuffers, StepInputs
from ferrum.model_executor.model_loader import load_model
from ferrum.model_executor.pipeline_stage import pipeline_stage
from ferrum.model_executor.runner_state import CachedRequestState
from ferrum.model_executor.speculative.proposer_model import KVShape, ProposerModel


class DraftModel(ProposerModel):
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
        arch = draft_config.arch
        model = load_model(
            draft_config,
            device,
            kernel_backend,
            TensorParallelGroup(),
            False,
            pipeline_stage(arch.num_hidden_layers, 0, 1),
            config.device_config.batch_invariant,
        )
        shape = KVShape(
            arch.num_hidden_layers, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
        )
        super().__init__(model, shape, config, kv_group, kernel_backend, device)
        self.graphs: CUDAGraphRunner | None = None

    def capture_graphs(self, target_graphs: CUDAGraphRunner) -> None:
        """Graphs of the target's shapes over the target's input buffers."""
        self.graphs = self.capture_like(self.model, target_graphs)

    def _forward(
        self, inputs: StepInputs, shape: tuple[int, int] | None, num_tokens: int
    ) -> torch.Tensor:
        hidden = self.run(self.model, self.graphs, inputs, shape, num_tokens)
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
        rows = self.lookahead_rows(states, max_drafts, block_size, 0)
        if not rows:
            return {}
        k = rows[0][2]
        drafts = torch.zeros((len(rows), k), dtype=torch.int64, device=self.device)
        previous = None
        for step in range(k):
            active = [row for row in rows if row[2] > step]
            n = len(active)
            step_inputs, shape = self.prepare_lookahead(inputs, active, step, self.graphs)
            if previous is not None:
                step_inputs.input_ids[:n].copy_(previous[:n])
            hidden = self._forward(step_inputs, shape, n)
            previous = self.model.compute_logits(hidden[:n]).argmax(dim=-1)
            drafts[:n, step] = previous
        host = drafts.tolist()
        return {state.req_id: host[i][:n] for i, (state, _, n) in enumerate(rows)}
