"""Benchmark workloads as token-id prompts (no tokenizer in the timed path).

`lat_prompt`, `batch` and `nano` mirror ../shared/bench/workloads.py (the recipes every peer engine
is timed with): same seeds, same draws in the same order, so figures are comparable. Token ids lie
in [0, 10000]; `fold_to_vocab` maps them into a smaller vocabulary and is the identity otherwise."""

from __future__ import annotations

import random

# The largest token id the recipes draw.
MAX_RECIPE_TOKEN_ID = 10000


def lat_prompt(seed: int = 0, n_in: int = 128) -> list[int]:
    """One prompt of `n_in` tokens (the `lat` workload)."""
    rng = random.Random(seed)
    return [rng.randint(0, MAX_RECIPE_TOKEN_ID) for _ in range(n_in)]


def batch(
    n: int, n_in: int = 256, n_out: int = 256, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """`n` prompts of `n_in` tokens and `n_out` output tokens each (`c16`, `c64`)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, MAX_RECIPE_TOKEN_ID) for _ in range(n_in)] for _ in range(n)]
    return prompts, [n_out] * n


def nano(
    seed: int = 0, num_seqs: int = 256, max_in: int = 1024, max_out: int = 1024
) -> tuple[list[list[int]], list[int]]:
    """`num_seqs` prompts, input U[100, max_in], output U[100, max_out] (the nano-vllm recipe)."""
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, MAX_RECIPE_TOKEN_ID) for _ in range(rng.randint(100, max_in))]
        for _ in range(num_seqs)
    ]
    outs = [rng.randint(100, max_out) for _ in range(num_seqs)]
    return prompts, outs


def fold_to_vocab(prompts: list[list[int]], vocab_size: int) -> list[list[int]]:
    """Token ids modulo `vocab_size`: unchanged when the vocabulary holds every recipe id."""
    if vocab_size > MAX_RECIPE_TOKEN_ID:
        return prompts
    return [[t % vocab_size for t in prompt] for prompt in prompts]
