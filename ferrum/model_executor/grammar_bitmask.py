"""The runner's structured-output bitmasks: filled on the host, copied to the device once a step.
Two pinned host buffers alternate: the one being filled was last read by the step before the
previous one, which has completed (at most one step is in flight while the next samples). The
device buffer (max_num_seqs rows) is read by the sampler in stream order, so the next step's copy
into it waits for nothing on the host."""

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
        self, states: Sequence[CachedRequestState], matchers: Mapping[str, StructuredOutputMatcher]
    ) -> torch.Tensor | None:
        """[len(states), vocab/32] int32 on the device: each constrained row's allowed next
        tokens, all ones elsewhere; None when no row is constrained. Below min_tokens a row's
        stop tokens are cleared, unless the grammar allows nothing else (it can only end: the
        request then stops there, with a valid output)."""
        rows = []
        for i, state in enumerate(states):
            matcher = matchers.get(state.req_id)
            if matcher is not None:
                num_outputs = len(state.output_token_ids) + state.num_output_placeholders
                below_min = num_outputs < state.params.min_tokens
                rows.append((i, matcher, state.params.all_stop_token_ids if below_min else ()))
        if not rows:
            return None
        host = self._host[self._num_fills % 2][: len(states)]
        self._num_fills += 1
        if len(rows) < len(states):
            host.fill_(-1)
        self._filler.fill(host, [(i, matcher) for i, matcher, _ in rows])
        for i, _, forbidden in rows:
            forbid_tokens_unless_only_ones(host, i, forbidden)
        if self._device is None:
            return host
        return self._device[: len(states)].copy_(host, non_blocking=True)
