"""The words the fused one-row LoRA GEMV (gemv_lora.py) synchronizes its programs through, one
set per layer: a count of the programs done with t (zero between launches), then READY_COPIES
copies of the ready flag, each in its own 128-byte line (SPREAD words apart) so that no word is
polled by every program. No Triton import: the LoRA layers allocate these on any backend."""

from __future__ import annotations

import torch

READY_COPIES = 32
SPREAD = 32
SYNC_WORDS = (1 + READY_COPIES) * SPREAD


def new_sync_words(device: torch.device) -> torch.Tensor:
    """One layer's count (zero) and ready flags (-1: no forward number, even an unraised one,
    finds them set; a launch that was not given a fresh number polls, then computes t itself)."""
    words = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=device)
    words[SPREAD::SPREAD] = -1
    return words
