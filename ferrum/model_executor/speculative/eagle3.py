"""An EAGLE-3 head proposes drafts (`method: eagle3`); its KV cache and graphs are a
`ProposerModel`'s. Row p of the head pairs the target's hidden states at position p (written by
the target's forward into `AuxHiddenStates`) with the token at p + 1 and predicts p + 2. Once a
step is sampled the head runs over the step's rows (`after_sampling`, `_StepPass`); when it
completes, draft 1 is the head's token at the row of each request's last emitted token and
drafts 2..k decode one at a time (`_DecodeStep`) from the previous draft and the head's own
pre-norm output, in the lookahead slots. A prefix-cache hit reuses the head's KV at the cached
block's last position, computed with the token that followed it in the request that filled it:
the same token, or a worse draft (never another output)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ferrum.config import EngineConfig
from ferrum.eagle3_config import Eagle3Config
from ferrum.model_arch import ModelArchConfig
from ferrum.model_executor.cuda_graph import CUDAGraphRunner
from ferrum.model_executor.input_batch import InputBuffers, RequestTokens, StepInputs
from ferrum.model_executor.layers.aux_hidden_states import AuxHiddenStates
from ferrum.model_executor.runner_state import CachedRequestState
from ferrum.model_executor.sampling_metadata import to_device
from ferrum.model_executor.speculative.eagle3_loader import load_eagle3_head
from ferrum.model_executor.speculative.proposer_model import KVShape, ProposerModel

# Per sampled row of a step: the head's (normed, pre-norm) outputs, [rows, hidden_size] each.
HeadRows = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class _PendingPass:
    """A launched target step whose head pass waits for its sampled tokens."""

    inputs: StepInputs
    shape: tuple[int, int] | None
    num_tokens: int
    # The last row of each prompt chunk that samples nothing, and the prompt token after it.
    chunk_rows: list[int]
    chunk_next_tokens: list[int]


class Eagle3Proposer(ProposerModel):
    def __init__(
        self,
        config: EngineConfig,
        head_config: Eagle3Config,
        target: nn.Module,
        max_num_tokens: int,
        kernel_backend: str,
        device: torch.device,
    ) -> None:
        """Loads the head and has `target` (a LlamaForCausalLM) write its aux hidden states
        for up to `max_num_tokens` tokens a forward."""
        dtype, batch_invariant, dummy_seed = head_load_options(config)
        head = load_eagle3_head(
            head_config, target, dtype, device, kernel_backend, batch_invariant, dummy_seed
        )
        self.aux = AuxHiddenStates(
            head_config.aux_layer_ids, max_num_tokens, head_config.target_hidden_size, dtype, device
        )
        target.model.aux_hidden_states = self.aux
        self.init_head(config, head, head_config.arch, self.aux.buffer, kernel_backend, device)

    def init_head(
        self,
        config: EngineConfig,
        head: nn.Module,
        arch: ModelArchConfig,
        hidden_buffer: torch.Tensor,
        kernel_backend: str,
        device: torch.device,
    ) -> None:
        """The proposer around a loaded `head` (an `Eagle3Head`'s interface: fuse, forward,
        draft_token_ids) of one attention layer of `arch`'s shapes, whose step pass reads row
        t's hidden input from `hidden_buffer[t]`."""
        shape = KVShape(1, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim)
        hidden_size = arch.hidden_size
        super().__init__(head, shape, config, 0, kernel_backend, device)
        self.head = head
        max_num_tokens = hidden_buffer.shape[0]
        dtype = hidden_buffer.dtype
        self.next_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        max_rows = max(max_num_tokens, config.scheduler_config.max_num_seqs)
        self.hidden_in = torch.zeros((max_rows, hidden_size), dtype=dtype, device=device)
        self.step_pass = _StepPass(head, self.next_ids, hidden_buffer)
        self.decode_step = _DecodeStep(head, self.hidden_in)
        self.pass_graphs: CUDAGraphRunner | None = None
        self.decode_graphs: CUDAGraphRunner | None = None
        self._pending: _PendingPass | None = None

    def capture_graphs(self, target_graphs: CUDAGraphRunner) -> None:
        """The pass's graphs for the target's shapes, the decode step's for its decode ones."""
        self.pass_graphs = self.capture_like(self.step_pass, target_graphs)
        self.decode_graphs = self.capture_like(self.decode_step, target_graphs, decode_only=True)

    def follow(
        self,
        inputs: StepInputs,
        shape: tuple[int, int] | None,
        num_tokens: int,
        requests: Mapping[str, RequestTokens],
        num_scheduled: Mapping[str, int],
        hidden_states: torch.Tensor | None,
    ) -> None:
        """After the target's forward of a step (before its computed counts advance): the
        head's pass waits for the sampled tokens, or runs now when the step samples none.
        `hidden_states`: the target's output (unused: the head reads aux hidden states)."""
        sampled = set(inputs.sampled_req_ids)
        rows, tokens, offset = [], [], 0
        for req_id, n in num_scheduled.items():
            offset += n
            if req_id not in sampled:
                state = requests[req_id]
                end = state.num_computed_tokens + n
                rows.append(offset - 1)
                # A chunk that samples nothing ends before the last known token.
                tokens.append(state.token_ids[end] if end < len(state.token_ids) else 0)
        self._pending = _PendingPass(inputs, shape, num_tokens, rows, tokens)
        if not sampled:
            self.after_sampling(None)

    def after_sampling(self, sampled: torch.Tensor | None) -> HeadRows | None:
        """Runs the pending pass with the step's sampled tokens (one per sampled row); returns
        the head's outputs at those rows (None when the step sampled none)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        inputs, n = pending.inputs, pending.num_tokens
        # Row p's next token: the step's next input token; after a sampled row the sampled
        # token (a verify step's row j samples after draft j: up to the last accepted row that
        # is the true next token, and the rows after it are rewritten before anything reads
        # them); after a prompt chunk that samples nothing, the next prompt token.
        self.next_ids[: n - 1].copy_(inputs.input_ids[1:n])
        if pending.chunk_rows:
            rows = to_device(pending.chunk_rows, torch.int64, self.device)
            self.next_ids[rows] = to_device(pending.chunk_next_tokens, torch.int64, self.device)
        if sampled is not None:
            if inputs.logits_indices is None:
                self.next_ids[:n].copy_(sampled[:n])
            else:
                self.next_ids[inputs.logits_indices] = sampled
        output = self.run(self.step_pass, self.pass_graphs, inputs, pending.shape, n)
        if sampled is None:
            return None
        normed, prenorm = output[0][:n], output[1][:n]
        if inputs.logits_indices is None:
            return normed.clone(), prenorm.clone()
        return normed[inputs.logits_indices], prenorm[inputs.logits_indices]

    def propose(
        self,
        inputs: InputBuffers,
        states: Sequence[CachedRequestState],
        max_drafts: Sequence[int],
        block_size: int,
        head_rows: HeadRows,
        row_of: Mapping[str, int],
    ) -> dict[str, list[int]]:
        """Greedy drafts past each request's last token, at most max_drafts[i] for states[i]
        (and no more than its slots hold); `row_of`: each request's row of its last emitted
        token in `head_rows`. One host sync, at the end."""
        # Only the first draft (no KV written) while a later step's pass is pending (its inputs
        # are in the buffers the decode steps would fill), and for requests a later launched
        # step holds (its pass wrote the head's KV at the positions the decode steps would
        # write with guesses): the scheduler replaces those drafts after that step.
        held = self._pending is not None
        limits = [
            min(n, 1) if held or s.num_output_placeholders else n
            for s, n in zip(states, max_drafts)
        ]
        rows = self.lookahead_rows(states, limits, block_size, 1)
        if not rows:
            return {}
        index = to_device([row_of[state.req_id] for state, _, _ in rows], torch.int64, self.device)
        previous = self.head.draft_token_ids(head_rows[0][index])
        hidden = head_rows[1][index]
        k = rows[0][2]
        drafts = torch.zeros((len(rows), k), dtype=torch.int64, device=self.device)
        drafts[:, 0] = previous
        for step in range(1, k):
            active = [row for row in rows if row[2] > step]
            n = len(active)
            graphs = self.decode_graphs
            step_inputs, shape = self.prepare_lookahead(inputs, active, step - 1, graphs)
            step_inputs.input_ids[:n].copy_(previous[:n])
            self.hidden_in[:n].copy_(hidden[:n])
            normed, hidden = self.run(self.decode_step, graphs, step_inputs, shape, n)
            previous = self.head.draft_token_ids(normed[:n])
            drafts[:n, step] = previous
        host = drafts.tolist()
        return {state.req_id: host[i][:n] for i, (state, _, n) in enumerate(rows)}


class _StepPass(nn.Module):
    """The head over a target step's padded rows: each row's next token from `next_ids`, its
    hidden state fused from the aux buffer (fixed addresses: a graph reads them)."""

    def __init__(self, head: nn.Module, next_ids: torch.Tensor, aux: torch.Tensor) -> None:
        super().__init__()
        self.head = head
        self.next_ids = next_ids
        self.aux = aux

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: object,
        intermediate: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = input_ids.shape[0]
        fused = self.head.fuse(self.aux[:n])
        return self.head(self.next_ids[:n], positions, attn_metadata, fused)


class _DecodeStep(nn.Module):
    """A head decode step: each row's previous draft and the head's output before it."""

    def __init__(self, head: nn.Module, hidden_in: torch.Tensor) -> None:
        super().__init__()
        self.head = head
        self.hidden_in = hidden_in

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: object,
        intermediate: object = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(input_ids, positions, attn_metadata, self.hidden_in[: input_ids.shape[0]])


def head_load_options(config: EngineConfig) -> tuple[torch.dtype, bool, int | None]:
    """(dtype, batch_invariant, dummy seed: the model's seed under load_format "dummy", else
    None) that a speculative head loads with."""
    model_config = config.model_config
    dummy_seed = model_config.seed if model_config.load_format == "dummy" else None
    dtype = getattr(torch, model_config.dtype)
    return dtype, config.device_config.batch_invariant, dummy_seed


def sampled_rows(
    req_ids: Sequence[str],
    drafts: Sequence[list[int]] | None,
    accepted: Mapping[str, list[int]],
) -> dict[str, int]:
    """Each request's row of its last emitted token among a step's sampled rows: its own row,
    or in a verify step (k + 1 rows per request with k drafts) the row after its accepted
    drafts."""
    rows, row = {}, 0
    for i, req_id in enumerate(req_ids):
        rows[req_id] = row + len(accepted.get(req_id, ()))
        row += 1 + (len(drafts[i]) if drafts is not None else 0)
    return rows
