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
from ferrum.structured_output import (
    BatchBitmaskFiller,
    FilledBitmaskRow,
    StructuredOutputMatcher,
)
from ferrum.structured_output.draft_rows import draft_row_starts

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
        matchers: Mapping[str, StructuredOutputMatcher | FilledBitmaskRow],
        drafts: Sequence[list[int]] | None = None,
    ) -> torch.Tensor | None:
        """[rows, vocab/32] int32 on the device, a row per state, or with `drafts` (a verify
        step) len(drafts[i]) + 1 rows for state i: each constrained row's allowed next tokens
        (after the drafts before it), all ones elsewhere; None when no row is constrained. Below
        min_tokens a row's stop tokens are cleared, unless the grammar allows nothing else (it
        can only end: the request then stops there, with a valid output)."""
        by_req = {} if drafts is None else {s.req_id: d for s, d in zip(states, drafts)}
        firsts, num_rows = draft_row_starts([s.req_id for s in states], by_req)
        rows, forbid = [], []
        for state, first in zip(states, firsts):
            matcher = matchers.get(state.req_id)
            if matcher is None:
                continue
            row_drafts = by_req.get(state.req_id, [])
            rows.append((first, matcher, row_drafts))
            num_outputs = len(state.output_token_ids) + state.num_output_placeholders
            for j in range(len(row_drafts) + 1):
                if num_outputs + j < state.params.min_tokens:
                    forbid.append((first + j, state.params.all_stop_token_ids))
        if not rows:
            return None
        host = self._host[self._num_fills % 2][:num_rows]
        self._num_fills += 1
        if sum(len(d) + 1 for _, _, d in rows) < num_rows:
            host.fill_(-1)
        self._filler.fill_with_drafts(host, rows)
        for row, forbidden in forbid:
            forbid_tokens_unless_only_ones(host, row, forbidden)
        if self._device is None:
            return host
        return self._device[:num_rows].copy_(host, non_blocking=True)
