"""The target's hidden states an EAGLE-3 head fuses: the residual stream at the input of some
decoder layers (vLLM's numbering: id i is the input of layer i, 0 the embedding), written by the
decoder stack during its forward into one buffer sized once at start-up, at a fixed address (a
CUDA graph of the target writes it, one of the head reads it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class AuxHiddenStates:
    def __init__(
        self,
        layer_ids: Sequence[int],
        max_num_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        # Row t holds token t's states at layer_ids[0], then layer_ids[1], ... (fc's input).
        self.buffer = torch.zeros(
            (max_num_tokens, len(layer_ids) * hidden_size), dtype=dtype, device=device
        )
        self.hidden_size = hidden_size
        # A layer named twice is written into each of its columns.
        self.slots: dict[int, list[int]] = {}
        for slot, layer in enumerate(layer_ids):
            self.slots.setdefault(layer, []).append(slot)

    def capture(self, layer_idx: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Called before decoder layer `layer_idx` runs on (hidden, residual): their sum (hidden
        alone before the first layer) into the layer's columns of the step's rows."""
        slots = self.slots.get(layer_idx)
        if slots is None:
            return
        size, rows = self.hidden_size, self.buffer[: hidden.shape[0]]
        for slot in slots:
            out = rows[:, slot * size : (slot + 1) * size]
            if residual is None:
                out.copy_(hidden)
            else:
                torch.add(hidden, residual, out=out)
