"""Two ranks (gloo processes) each run their shard of every architecture through the runner and
a scheduler: the greedy tokens equal tp=1's, and both ranks sample the same tokens (a seeded
sampled request included), with chunked prefill, prefix-cache hits and preemptions."""

from __future__ import annotations

import pytest

from tests.utils.rank_pool import RankPool
from tests.utils.tp_generate import generate, generate_on_rank

# (tiny checkpoint arch, its config overrides, ParallelConfig fields)
CASES = {
    "llama-sharded-checkpoint": ("llama", {}, {}),
    "qwen2-tied-odd-vocab": ("qwen2", {"vocab_size": 383}, {}),
    "qwen3-one-kv-head": ("qwen3", {"num_key_value_heads": 1}, {}),
    "mistral-sliding-window": ("mistral_sw", {}, {}),
    "gemma3": ("gemma3", {}, {}),
    "qwen3_moe": ("qwen3_moe", {}, {}),
    "qwen3_moe-expert-parallel": ("qwen3_moe", {}, {"enable_expert_parallel": True}),
}


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2)
    yield ranks
    ranks.close()


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_generate_what_one_does(pool, tiny_checkpoint, case) -> None:
    arch, overrides, parallel = CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    expected = generate(path)
    assert expected["num_preemptions"] > 0 and expected["prefix_cache_hits"] > 0
    rank0, rank1 = pool.run(generate_on_rank, path, parallel)
    assert rank0 == rank1
    # Greedy requests are exact; the seeded sampled one only has to agree between the ranks.
    assert rank0["tokens"][:-1] == expected["tokens"][:-1]
    assert rank0["num_preemptions"] == expected["num_preemptions"]
    assert rank0["prefix_cache_hits"] == expected["prefix_cache_hits"]
