"""The next-token bitmask on the runner's side (layout: `structured_output/bitmask_layout.py`):
host buffers, rows forbidden or freed on the host, and the mask applied to the logits on the
device: one mask for every row, no index lists, fixed shapes, no host sync."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xgrammar as xgr

from ferrum.structured_output.bitmask_layout import ALL_ALLOWED, bitmask_width, int32_bit


def allocate_token_bitmask(
    num_rows: int, vocab_size: int, *, pin_memory: bool = False
) -> torch.Tensor:
    """A host bitmask with every token allowed in every row; sized once by its owner."""
    return torch.full(
        (num_rows, bitmask_width(vocab_size)), ALL_ALLOWED, dtype=torch.int32, pin_memory=pin_memory
    )


def allow_all_tokens(bitmask: torch.Tensor, row: int) -> None:
    """Marks `row` unconstrained."""
    bitmask[row].fill_(ALL_ALLOWED)


def forbid_tokens_unless_only_ones(
    bitmask: torch.Tensor, row: int, token_ids: Iterable[int]
) -> bool:
    """Clears the bits of `token_ids` in host row `row`, unless no other token is allowed there
    (then the row is left as it was). Returns whether they were cleared."""
    num_tokens = bitmask.shape[1] * 32
    cleared: dict[int, int] = {}
    for token_id in token_ids:
        if 0 <= token_id < num_tokens:
            word = token_id // 32
            cleared[word] = cleared.get(word, 0) | int32_bit(token_id % 32)
    if not cleared:
        return True
    saved = {word: int(bitmask[row, word]) for word in cleared}
    for word, bits in cleared.items():
        bitmask[row, word] = saved[word] & ~bits
    if bool(bitmask[row].any()):
        return True
    for word, value in saved.items():
        bitmask[row, word] = value
    return False


def _check(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [num_rows, vocab_size], got shape {tuple(logits.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(
            f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(
            f"bitmask has {bitmask.shape[0]} rows but logits have {logits.shape[0]}: one row each"
        )
    if bitmask.shape[1] < bitmask_width(logits.shape[1]):
        raise ValueError(
            f"bitmask has {bitmask.shape[1]} words per row, logits of {logits.shape[1]} tokens "
            f"need {bitmask_width(logits.shape[1])}"
        )
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device} but logits are on {logits.device}")


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets `logits[r, j] = -inf` wherever the bitmask forbids token j in row r, in place.

    `bitmask` must already be on `logits`' device (copy it there while the forward runs).
    Uses xgrammar's kernels: C++ on the CPU, Triton on CUDA; float32, float16 and bfloat16.
    """
    _check(logits, bitmask)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1])


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The torch definition of `apply_token_bitmask_` (out of place), for tests."""
    _check(logits, bitmask)
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [num_rows, words, 32]
    allowed = bits.flatten(1)[:, : logits.shape[1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))
