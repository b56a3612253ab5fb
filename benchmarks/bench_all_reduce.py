"""All-reduce latency of the decode-sized messages the tensor-parallel layers send, through
NCCL (torch.distributed) and, with --symm-mem, torch symmetric memory, eager and replayed in a
CUDA graph.

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
import torch.distributed as dist
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


def _graph_us(fn, iters: int) -> float:
    """Microseconds per call of `fn` replayed CALLS_PER_GRAPH times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    result = _time_us(graph.replay, iters) / CALLS_PER_GRAPH
    torch.cuda.synchronize()
    del graph
    return result


def _row(impl: str, dtype: torch.dtype, tokens: int, nbytes: int, fn, args) -> dict:
    for _ in range(args.warmup):
        fn()
    return {
        "impl": impl,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": tokens,
        "bytes": nbytes,
        "eager_us": round(_time_us(fn, args.iters), 2),
        "cuda_graph_us": round(_graph_us(fn, args.iters), 2),
    }


def _symm_mem_rows(args: argparse.Namespace) -> list[dict]:
    """torch symmetric memory's one-shot and two-shot all-reduce (peer loads over NVLink, no
    multicast), each including the copy of the layer's output into the symmetric buffer."""
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    dtype = torch.bfloat16
    symm = symm_mem.empty(max(TOKENS) * args.hidden, dtype=dtype, device="cuda")
    symm_mem.rendezvous(symm, group_name)
    rows = []
    for tokens in TOKENS:
        source = torch.randn(tokens, args.hidden, dtype=dtype, device="cuda")
        out = torch.empty_like(source)
        view = symm[: source.numel()]

        def one_shot(src=source, view=view, out=out) -> None:
            view.copy_(src.view(-1))
            torch.ops.symm_mem.one_shot_all_reduce_out(view, "sum", group_name, out.view(-1))

        def two_shot(src=source, view=view, out=out) -> None:
            view.copy_(src.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group_name)
            out.view(-1).copy_(view)

        nbytes = source.numel() * source.element_size()
        for impl, fn in (("symm_mem_one_shot", one_shot), ("symm_mem_two_shot", two_shot)):
            try:
                rows.append(_row(impl, dtype, tokens, nbytes, fn, args))
            except Exception as e:  # report why, keep the NCCL rows
                rows.append({"impl": impl, "tokens": tokens, "error": repr(e)[:300]})
    return rows


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    torch.cuda.set_device(rank)
    # NCCL for every message here: the symmetric-memory rows are timed on their own below.
    group = init_distributed(
        args.world_size, rank, f"tcp://127.0.0.1:{port}", "nccl", custom_all_reduce=False
    )
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in TOKENS:
            buffer = torch.randn(tokens, args.hidden, dtype=dtype, device="cuda")
            nbytes = buffer.numel() * buffer.element_size()
            results.append(
                _row("nccl", dtype, tokens, nbytes, lambda b=buffer: group.all_reduce(b), args)
            )
    if args.symm_mem:
        try:
            results.extend(_symm_mem_rows(args))
        except Exception as e:
            results.append({"impl": "symm_mem", "error": repr(e)[:300]})
    if rank == 0:
        lines = [
            json.dumps({"world_size": args.world_size, "hidden": args.hidden, **r}) for r in results
        ]
        print("\n".join(lines), flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    torch.cuda.synchronize()
    dist.barrier()
    destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--symm-mem",
        action="store_true",
        help="also time torch symmetric memory's one-shot / two-shot all-reduce (bf16)",
    )
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
