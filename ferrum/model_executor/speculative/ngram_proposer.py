"""Prompt lookup: the drafts are the tokens that followed the latest earlier occurrence of the
request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) drafts for the tokens after
        `token_ids`; [] when no n-gram of the allowed sizes occurred before."""
        k = min(self.num_speculative_tokens, max_drafts)
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. length - n - 1: every earlier occurrence of the suffix.
            windows = sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return token_ids[start : start + k]
        return []
