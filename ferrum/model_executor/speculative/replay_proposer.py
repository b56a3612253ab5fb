"""A benchmark proposer (not a product feature): it replays recorded greedy continuations of
the benchmark's prompts, each draft replaced by a wrong token with probability
1 - acceptance_rate, so that the acceptance rate is set rather than learned."""

from __future__ import annotations

import json
import random


class ReplayProposer:
    def __init__(
        self, num_speculative_tokens: int, path: str, acceptance_rate: float, vocab_size: int
    ) -> None:
        """`path`: JSON {"<prompt token ids joined by ','>": [continuation token ids]}."""
        with open(path) as f:
            recorded = json.load(f)
        self.continuations = {
            tuple(int(t) for t in key.split(",")): list(value) for key, value in recorded.items()
        }
        self.num_speculative_tokens = num_speculative_tokens
        self.acceptance_rate = acceptance_rate
        self.vocab_size = vocab_size
        self.rng = random.Random(0)

    def propose(
        self, prompt_token_ids: list[int], output_token_ids: list[int], max_drafts: int
    ) -> list[int]:
        continuation = self.continuations.get(tuple(prompt_token_ids))
        if continuation is None:
            return []
        done = len(output_token_ids)
        drafts = continuation[done : done + min(self.num_speculative_tokens, max_drafts)]
        return [
            t if self.rng.random() < self.acceptance_rate else (t + 1) % self.vocab_size
            for t in drafts
        ]
