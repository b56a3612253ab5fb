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
