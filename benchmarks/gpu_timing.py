"""GPU timers shared by the kernel benchmarks."""

from collections.abc import Callable

import torch


def graph_us(fn: Callable[[int], object], num_copies: int, iters: int) -> float:
    """GPU microseconds per call of `fn(i)`: a CUDA graph of `iters` calls cycling i over
    `num_copies` (copies of a weight, so that the timed calls stream from HBM rather than L2),
    the median of three replays after one untimed one (`ferrum tune`'s timer). Launch overhead
    is left out, as in the engine's graphs."""
    from ferrum.bench.tune_gpu import graph_time_us

    return graph_time_us(fn, num_copies, iters, repeats=3)


def launches_ms(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    """GPU milliseconds per call of `fn`: `iters` eager launches back to back between two CUDA
    events, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def graph_replay_ms(fn: Callable[[], object], replays: int, warmup_replays: int = 5) -> float:
    """Median milliseconds of one replay of a CUDA graph of `fn()`: two eager calls on a side
    stream first (kernel compiles and the allocator settle outside the capture), then
    `warmup_replays` untimed replays, then `replays` timed one at a time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(warmup_replays):
        graph.replay()
    torch.cuda.synchronize()
    from ferrum.bench.tune_gpu import median_replay_ms

    return median_replay_ms(graph, replays)
