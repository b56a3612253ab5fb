"""All-reduce latency of the decode-sized messages the tensor-parallel layers send, through
`TensorParallelGroup` (NCCL via torch.distributed), eager and replayed in a CUDA graph.

Needs N >= 2 GPUs (NCCL refuses two ranks on one device). One process per GPU; rank 0 prints one
JSON line per (dtype, tokens): the message is [tokens, hidden] (one row-parallel output), the
times are microseconds per all-reduce, median over --iters calls, after --warmup.

    python benchmarks/bench_all_reduce.py --world-size 2 --hidden 4096 --out $OUT/all_reduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics

import torch
import torch.multiprocessing as mp

from ferrum.distributed.parallel_state import destroy_distributed, init_distributed

TOKENS = (1, 8, 32, 64, 128, 256, 512)
# All-reduces per graph replay, so one replay's launch overhead is spread thin (as in a model).
CALLS_PER_GRAPH = 20


def _time_us(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(samples)


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.cuda.set_device(rank)
    group = init_distributed(args.world_size, rank, f"tcp://127.0.0.1:{port}", "nccl")
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in TOKENS:
            buffer = torch.randn(tokens, args.hidden, dtype=dtype, device="cuda")
            for _ in range(args.warmup):
                group.all_reduce(buffer)
            eager = _time_us(lambda b=buffer: group.all_reduce(b), args.iters)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(CALLS_PER_GRAPH):
                    group.all_reduce(buffer)
            graph.replay()
            graphed = _time_us(graph.replay, args.iters) / CALLS_PER_GRAPH
            results.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "tokens": tokens,
                    "bytes": buffer.numel() * buffer.element_size(),
                    "eager_us": round(eager, 2),
                    "cuda_graph_us": round(graphed, 2),
                }
            )
    if rank == 0:
        lines = [
            json.dumps({"world_size": args.world_size, "hidden": args.hidden, **r}) for r in results
        ]
        print("\n".join(lines))
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(
            f"--world-size {args.world_size} needs as many GPUs; {torch.cuda.device_count()} found"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # multicast is off on the lent machines
    mp.spawn(_rank_main, args=(args, port), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
