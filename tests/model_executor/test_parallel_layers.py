"""The tensor-parallel layers on two gloo ranks against the same layers whole: column, merged
and q/k/v column-parallel (KV heads split and replicated), row-parallel, vocabulary-parallel
embedding and LM head (odd vocabulary), MoE split by intermediate rows and by experts; and the
loader reads only each rank's part of the checkpoint."""

from __future__ import annotations

import pytest
import torch

from ferrum.config import ModelConfig
from tests.utils.parallel_layer_tasks import checkpoint_reads, linear_layers, moe_layers


@pytest.mark.parametrize("task", [linear_layers, moe_layers])
def test_split_layers_compute_the_whole_layers_part(gloo_ranks, task) -> None:
    for rank, pairs in enumerate(gloo_ranks.run(task)):
        for name, (mine, expected) in pairs.items():
            assert mine.shape == expected.shape, (rank, name)
            torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-5, msg=f"{rank} {name}")


# Parameters every rank holds whole (read in full by each rank).
_REPLICATED = ("norm", ".mlp.gate.")


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_reads_only_its_part_of_the_checkpoint(
    gloo_ranks, tiny_checkpoint, expert_parallel
):
    config = ModelConfig(tiny_checkpoint("qwen3_moe"), dtype="float32")
    ranks = gloo_ranks.run(checkpoint_reads, config, expert_parallel)
    for reads in ranks:
        for name, shape, whole in reads:
            # Expert parallel: whole experts, only this rank's.
            whole_read = any(r in name for r in _REPLICATED) or (
                expert_parallel and ".experts." in name
            )
            assert torch.Size(shape).numel() * (1 if whole_read else 2) == whole, name
        experts_read = {name for name, _, _ in reads if ".experts." in name}
        # 3 layers, 2 of them MoE with 8 experts of 3 tensors each.
        assert len(experts_read) == (24 if expert_parallel else 48)
    read_by = [{name for name, _, _ in reads if ".experts." in name} for reads in ranks]
    if expert_parallel:
        assert not read_by[0] & read_by[1]
