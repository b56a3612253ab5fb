"""The runner's structured-output bitmasks: filled on the host, copied to the device once a step.

Two pinned host buffers alternate between fills: the one being filled was last read by the step
before the previous one, which has completed (at most one step is in flight while the next one
samples). The device buffer is sized once (max_num_seqs rows) and read by the sampler in stream
order, so the next step's copy into it waits for nothing on the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ferrum.structured_output import (
    BatchBitmaskFiller,
    StructuredOutputMatcher,
    allocate_token_bitmask,
    forbid_tokens_unless_only_ones,
)


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
        num_rows: int,
        rows: Sequence[tuple[int, StructuredOutputMatcher, Iterable[int]]],
    ) -> torch.Tensor:
        """[num_rows, vocab/32] int32 on the device: for each `(i, matcher, forbidden)` row i
        allows the matcher's next tokens less `forbidden` (unless nothing else is allowed: then
        it keeps them); every other row allows everything."""
        host = self._host[self._num_fills % 2][:num_rows]
        self._num_fills += 1
        if len(rows) < num_rows:
            host.fill_(-1)
        self._filler.fill(host, [(i, matcher) for i, matcher, _ in rows])
        for i, _, forbidden in rows:
            forbid_tokens_unless_only_ones(host, i, forbidden)
        if self._device is None:
            return host
        return self._device[:num_rows].copy_(host, non_blocking=True)
