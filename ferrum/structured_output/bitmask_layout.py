"""The next-token bitmask's layout (xgrammar's): int32 `[num_rows, ceil(vocab_size / 32)]`; bit
`j % 32` of word `j // 32` of row `r` is 1 iff token `j` is allowed in row `r`. A row of all ones
(-1) constrains nothing, so a batch mixing constrained and free requests applies one mask to all
rows. Matchers fill host rows (`matcher.py`); the runner applies them (`token_bitmask.py`)."""

from __future__ import annotations

ALL_ALLOWED = -1  # an int32 word with all 32 bits set


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def int32_bit(position: int) -> int:
    """The int32 value with only bit `position` set."""
    return (1 << position) - (1 << 32 if position == 31 else 0)
