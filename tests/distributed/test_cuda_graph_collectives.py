"""On two GPUs (NCCL): the collectives the layers call are captured in CUDA graphs and replay
correctly, and a tp=2 runner with CUDA graphs and Triton kernels decodes what tp=1 decodes.
Skipped without two CUDA devices (run on a multi-GPU machine)."""

from __future__ import annotations

import pytest
import torch

from tests.utils.collective_tasks import (
    bf16_all_reduce_sums,
    collectives_in_cuda_graph,
    rank_values,
)
from tests.utils.rank_pool import RankPool
from tests.utils.tp_generate import generate, generate_on_rank

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2, backend="nccl")
    yield ranks
    ranks.close()


class _Rank:
    def __init__(self, rank: int) -> None:
        self.rank = rank


def test_collectives_replay_in_a_cuda_graph(pool) -> None:
    r0, r1 = rank_values(_Rank(0)), rank_values(_Rank(1))
    for result in pool.run(collectives_in_cuda_graph):
        assert torch.equal(result["all_reduce"], r0 + r1)
        assert torch.equal(result["all_gather"], torch.cat([r0, r1], dim=-1))


def test_small_bf16_all_reduces_sum_exactly_eager_and_in_graphs(pool) -> None:
    for result in pool.run(bf16_all_reduce_sums):
        assert result["symm_mem"], "the symmetric-memory all-reduce did not initialise"
        assert all(result["matches"].values()), result["matches"]


@pytest.mark.parametrize(
    ("arch", "parallel"), [("qwen3", {}), ("qwen3_moe", {"enable_expert_parallel": True})]
)
def test_two_gpus_with_cuda_graphs_decode_what_one_does(pool, tiny_checkpoint, arch, parallel):
    path = tiny_checkpoint(arch)
    expected = generate(path, cuda=True)
    rank0, rank1 = pool.run(generate_on_rank, path, parallel, True)
    assert rank0 == rank1
    assert rank0["tokens"][:-1] == expected["tokens"][:-1]
