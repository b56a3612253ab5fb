"""Functions that each rank of a RankPool runs for tests/distributed (module level: picklable)."""

from __future__ import annotations

import torch

from ferrum.distributed.parallel_state import TensorParallelGroup


def rank_values(group: TensorParallelGroup) -> torch.Tensor:
    """[2, 3] float tensor that differs per rank: rank * 10 + index."""
    return torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * group.rank


def run_collectives(group: TensorParallelGroup) -> dict[str, object]:
    mine = rank_values(group)
    gathered = group.gather(mine.clone(), dim=1)
    broadcast = torch.full((2,), float(group.rank))
    return {
        "rank": group.rank,
        "world_size": group.world_size,
        "all_reduce": group.all_reduce(mine.clone()),
        "all_gather_0": group.all_gather(mine, dim=0),
        "all_gather_1": group.all_gather(mine, dim=-1),
        "gather": gathered,
        "broadcast": group.broadcast(broadcast, src=1),
    }


def collectives_in_cuda_graph(group: TensorParallelGroup) -> dict[str, torch.Tensor]:
    """all_reduce and all_gather captured in one CUDA graph, replayed on new input values."""
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = torch.zeros(2, 3, device=device)
    group.all_reduce(buffer.clone())  # warm-up outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gathered = group.all_gather(buffer * 1.0, dim=-1)
        reduced = group.all_reduce(buffer)
    buffer.copy_(rank_values(group).to(device))
    graph.replay()
    torch.cuda.synchronize()
    return {"all_reduce": reduced.cpu(), "all_gather": gathered.cpu()}


# [tokens, 4096] bf16 all-reduces: one-shot, two-shot and past the symmetric buffer (NCCL).
SMALL_ALL_REDUCE_TOKENS = (1, 64, 128, 512, 600)


def _bf16_values(rank: int, tokens: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + tokens)
    values = torch.randn(tokens, 4096, generator=generator)
    return values.to(device=device, dtype=torch.bfloat16)


def bf16_all_reduce_sums(group: TensorParallelGroup) -> dict[str, object]:
    """Every size of SMALL_ALL_REDUCE_TOKENS, eager and replayed in a CUDA graph: whether each
    result equals the sum of every rank's values (rounded once to bf16, as NCCL does)."""
    device = torch.device("cuda", torch.cuda.current_device())
    matches: dict[str, bool] = {}
    for tokens in SMALL_ALL_REDUCE_TOKENS:
        parts = [_bf16_values(r, tokens, device).float() for r in range(group.world_size)]
        expected = torch.stack(parts).sum(0).to(torch.bfloat16)
        mine = _bf16_values(group.rank, tokens, device)
        matches[f"eager_{tokens}"] = torch.equal(group.all_reduce(mine.clone()), expected)
        source = torch.zeros_like(mine)
        group.all_reduce(source.clone())  # warm-up outside capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            reduced = group.all_reduce(source)
            reduced_twice = group.all_reduce(reduced * 1.0)
        source.copy_(mine)
        graph.replay()
        torch.cuda.synchronize()
        matches[f"graph_{tokens}"] = torch.equal(reduced, expected)
        twice = (expected.float() * group.world_size).to(torch.bfloat16)
        matches[f"graph_twice_{tokens}"] = torch.equal(reduced_twice, twice)
    return {"symm_mem": group._small_all_reduce is not None, "matches": matches}
