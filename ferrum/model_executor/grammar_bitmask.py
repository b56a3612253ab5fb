"""The runner's structured-output bitmasks: filled on the host, copied to the device once a step.
Two pinned host buffers alternate: the one being filled was last read by the step before the
previous one, which has completed (at most one step is in flight while the next samples). The
device buffer (a row per sampled row: max_num_seqs x (1 + drafts) rows) is read by the sampler in
stream order, so the next step's copy into it waits for nothing on the host."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ferrum.model_executor.token_bitmask import (
    allocate_token_bitmask,
    forbid_tokens_unless_only_ones,
)
from ferrum.structured_output import BatchBitmaskFiller, StructuredOutputMatcher

if TYPE_CHECKING:
    from ferrum.model_executor.runner_state import CachedRequestState


class GrammarBitmaskBuffers:
    def __init__(self, max_num_rows: int, vocab_size: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._host = [
            allocate_token_bitmask(max_num_rows, vocab_size, pin_memory=pin) for _ in range(2)
        ]
        self._device = allocate_token_bitmask(max_num_rows, vocab_size).to(device) if pin else None
        self._num_fills = 0
        self._filler = BatchBitmaskFiller()

    def fill(
        self,
        states: Sequence[CachedRequestState],
        matchers: Mapping[str, StructuredOutputMatcher],
        drafts: Sequence[list[int]] | None = None,
    ) -> torch.Tensor | None:
        """[rows, vocab/32] int32 on the device, a row per state, or with `drafts` (a verify
        step) len(drafts[i]) + 1 rows for state i: each constrained row's allowed next tokens
        (after the drafts before it), all ones elsewhere; None when no row is constrained. Below
        min_tokens a row's stop tokens are cleared, unless the grammar allows nothing else (it
        can only end: the request then stops there, with a valid output)."""
        counts = [1] * len(states) if drafts is None else [len(d) + 1 for d in drafts]
        firsts = [sum(counts[:i]) for i in range(len(states))]
        batch, looking_ahead, forbid = [], [], []
        for i, state in enumerate(states):
            matcher = matchers.get(state.req_id)
            if matcher is None:
                continue
            if counts[i] == 1:
                batch.append((firsts[i], matcher))
            else:
                assert drafts is not None
                looking_ahead.append((firsts[i], matcher, drafts[i]))
            num_outputs = len(state.output_token_ids) + state.num_output_placeholders
            for j in range(counts[i]):
                if num_outputs + j < state.params.min_tokens:
                    forbid.append((firsts[i] + j, state.params.all_stop_token_ids))
        if not batch and not looking_ahead:
            return None
        num_rows = sum(counts)
        host = self._host[self._num_fills % 2][:num_rows]
        self._num_fills += 1
        if len(batch) + sum(len(d) + 1 for _, _, d in looking_ahead) < num_rows:
            host.fill_(-1)
        self._filler.fill(host, batch)
        for first, matcher, row_drafts in looking_ahead:
            matcher.fill_bitmask_after_drafts(host, first, row_drafts)
        for row, forbidden in forbid:
            forbid_tokens_unless_only_ones(host, row, forbidden)
        if self._device is None:
            return host
        return self._device[:num_rows].copy_(host, non_blocking=True)
