"""Prompt logprobs (`SamplingParams.prompt_logprobs`): for prompt position p >= 1, the logprob
of prompt token p given tokens [0, p) under the raw logits (no sampling option applies), its rank
(1 = most likely), and the k most likely tokens. The logits come from the hidden state at p - 1,
so a prefill chunk covering positions [start, end) yields positions [start + 1, end + 1) capped
at the prompt's last token; chunks of one prompt arrive in order, one per step."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ferrum.model_executor.sampling_metadata import to_device
from ferrum.request import Logprobs

if TYPE_CHECKING:
    from ferrum.sampling_params import ResolvedSamplingParams

# Rows of [rows, vocab] float32 logits materialized at once (~150 MB for a 151,936 vocabulary).
_MAX_ROWS_PER_PASS = 256


@dataclass(slots=True)
class PromptLogprobsChunk:
    """One request's prompt logprobs from one step, on the device until `to_host`."""

    req_id: str
    first_position: int
    target_ids: list[int]  # the m prompt tokens scored, from first_position on
    token_logprobs: torch.Tensor  # [m] float32
    ranks: torch.Tensor  # [m] int64
    top_ids: torch.Tensor  # [m, k] int64
    top_values: torch.Tensor  # [m, k] float32

    def to_host(self) -> tuple[int, list[Logprobs]]:
        """(first position, one `Logprobs` per position: the prompt token, then the top-k)."""
        token_ids = self.top_ids.tolist()
        values = self.top_values.tolist()
        targets = self.token_logprobs.tolist()
        ranks = self.ranks.tolist()
        return self.first_position, [
            Logprobs(token_ids=[target_id, *ids], logprobs=[target, *vals], sampled_rank=rank)
            for target_id, ids, vals, target, rank in zip(
                self.target_ids, token_ids, values, targets, ranks, strict=True
            )
        ]


@dataclass(slots=True)
class PromptRows:
    """Where one request's prompt positions sit in a step's hidden states."""

    req_id: str
    first_row: int  # row of the hidden state of position first_position - 1
    first_position: int
    target_ids: list[int]  # prompt tokens first_position, first_position + 1, ...
    num_logprobs: int


class PromptState(Protocol):
    prompt_token_ids: list[int]
    num_computed_tokens: int
    params: ResolvedSamplingParams


def step_prompt_logprobs(
    hidden_states: torch.Tensor | None,
    requests: Mapping[str, PromptState],
    num_scheduled: Mapping[str, int],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[PromptLogprobsChunk]:
    """A step's chunks, queued on the device, from its requests' states before its tokens count
    as computed; none without hidden states (a pipeline stage before the last)."""
    if hidden_states is None:
        return []
    views = {}
    for req_id in num_scheduled:
        s = requests[req_id]
        views[req_id] = (s.prompt_token_ids, s.num_computed_tokens, s.params.prompt_logprobs)
    return [
        compute_prompt_logprobs(hidden_states, rows, compute_logits)
        for rows in prompt_rows(views, num_scheduled)
    ]


def prompt_rows(
    requests: Mapping[str, tuple[list[int], int, int | None]], num_scheduled: Mapping[str, int]
) -> list[PromptRows]:
    """The scored positions of a step. `requests[req_id]`: (prompt token ids, tokens computed
    before this step, prompt_logprobs or None); rows follow `num_scheduled`'s order, each request
    contiguous."""
    result = []
    row = 0
    for req_id, n in num_scheduled.items():
        prompt, start, k = requests[req_id]
        end = min(start + n, len(prompt) - 1)  # the last prompt token predicts no prompt token
        if k is not None and start < end:
            result.append(PromptRows(req_id, row, start + 1, prompt[start + 1 : end + 1], k))
        row += n
    return result


def compute_prompt_logprobs(
    hidden_states: torch.Tensor,
    rows: PromptRows,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
) -> PromptLogprobsChunk:
    """Queues the computation of one request's chunk on the device (no host sync)."""
    num = len(rows.target_ids)
    targets = to_device(rows.target_ids, torch.int64, hidden_states.device)
    pieces = []
    for begin in range(0, num, _MAX_ROWS_PER_PASS):
        stop = min(begin + _MAX_ROWS_PER_PASS, num)
        states = hidden_states[rows.first_row + begin : rows.first_row + stop]
        logprobs = compute_logits(states).float().log_softmax(dim=-1)
        target = logprobs.gather(1, targets[begin:stop, None])
        ranks = (logprobs > target).sum(dim=-1) + 1
        top_values, top_ids = logprobs.topk(rows.num_logprobs, dim=-1)
        pieces.append((target[:, 0], ranks, top_ids, top_values))
    return PromptLogprobsChunk(
        rows.req_id,
        rows.first_position,
        rows.target_ids,
        *(torch.cat(parts) for parts in zip(*pieces, strict=True)),
    )
