"""The tokens of a LoRA batch grouped by adapter slot, for the Triton shrink and expand: tokens
sorted by slot (those without an adapter, slot -1, first) and each slot's first position and
count in that order. Written into buffers owned by the caller, with no host sync, so a CUDA
graph's replay reads the current step's grouping."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def block_m(num_tokens: int) -> int:
    """Token tile: 16 rows for decode-sized batches, 64 for prompt chunks (fewer idle
    programs over a long chunk's slots). A rule of the token count alone (CUDA-graph safe)."""
    return 16 if num_tokens <= 256 else 64


@dataclass(slots=True)
class LoRASegments:
    sorted_tokens: torch.Tensor  # [max_tokens] int32: token ids ordered by slot
    slot_starts: torch.Tensor  # [num_slots] int32: first position of each slot's tokens
    slot_counts: torch.Tensor  # [num_slots] int32: tokens of each slot

    @classmethod
    def empty(cls, max_tokens: int, num_slots: int, device: torch.device) -> LoRASegments:
        """The grouping of a batch without adapters (every token in order, no slot counts):
        what a captured graph reads before the first step with an adapter regroups."""

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        in_order = torch.arange(max_tokens, dtype=torch.int32, device=device)
        return cls(in_order, zeros(num_slots), zeros(num_slots))

    def fill(self, token_slots: torch.Tensor) -> None:
        """Groups `token_slots` [T] (T <= max_tokens; -1 or a slot < num_slots)."""
        num_tokens, num_slots = token_slots.shape[0], self.slot_counts.shape[0]
        order = torch.argsort(token_slots, stable=True)
        self.sorted_tokens[:num_tokens].copy_(order)
        counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=token_slots.device)
        counts.scatter_add_(
            0, (token_slots + 1).long(), torch.ones_like(token_slots, dtype=torch.int32)
        )
        ends = torch.cumsum(counts, 0, dtype=torch.int32)
        self.slot_counts.copy_(counts[1:])
        self.slot_starts.copy_(ends[:-1])
