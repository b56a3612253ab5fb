"""TensorParallelGroup's collectives over two gloo processes match their definitions; a group of
one rank is a no-op that needs no torch.distributed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ferrum.distributed.parallel_state import TensorParallelGroup, init_distributed
from tests.utils.collective_tasks import rank_values, run_collectives


class _Rank:
    def __init__(self, rank: int) -> None:
        self.rank = rank


def test_collectives_over_two_processes(gloo_ranks) -> None:
    results = gloo_ranks.run(run_collectives)
    r0, r1 = rank_values(_Rank(0)), rank_values(_Rank(1))
    for rank, result in enumerate(results):
        assert (result["rank"], result["world_size"]) == (rank, 2)
        assert torch.equal(result["all_reduce"], r0 + r1)
        assert torch.equal(result["all_gather_0"], torch.cat([r0, r1], dim=0))
        assert torch.equal(result["all_gather_1"], torch.cat([r0, r1], dim=1))
        assert torch.equal(result["broadcast"], torch.ones(2))
    assert torch.equal(results[0]["gather"], torch.cat([r0, r1], dim=1))
    assert results[1]["gather"] is None


def test_single_rank_group_is_a_no_op() -> None:
    group = init_distributed(1, 0, "tcp://127.0.0.1:1", "gloo")
    assert not dist.is_initialized()
    x = torch.randn(3, 4)
    assert group.all_reduce(x) is x and group.all_gather(x) is x and group.broadcast(x) is x
    assert group.gather(x) is x
    assert (group.rank, group.world_size) == (0, 1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 0, "tcp://127.0.0.1:1", "mpi"), "backend: must be one of"),
        ((0, 0, "tcp://127.0.0.1:1", "gloo"), "world_size: must be an integer >= 1"),
        ((2, 2, "tcp://127.0.0.1:1", "gloo"), r"rank: must be in \[0, 2\)"),
    ],
)
def test_init_distributed_rejects_bad_arguments(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        init_distributed(*args)


def test_group_of_several_ranks_needs_a_process_group() -> None:
    with pytest.raises(ValueError, match="world_size: a group of 2 ranks needs"):
        TensorParallelGroup(0, 2)
