"""Times decode paged attention (one query token per request) over a grid of launch configs.

Shapes of a model's attention (`--num-heads 16 --num-kv-heads 8 --head-dim 128`: Qwen3-0.6B),
bf16, `--batch` requests of `--context` keys each on blocks of 16 scattered over a shuffled pool.
Each config runs `--iters` launches back to back between two CUDA events; prints microseconds per
launch and the HBM bandwidth of the K and V bytes read, default config first.
Usage: python benchmarks/bench_attention.py [--batch 256] [--context 1024] [--out file.json]
"""

# ruff: noqa: E402
import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.gpu_timing import launches_ms
from ferrum.kernels.paged_attention import paged_attention_unified

BLOCK_SIZE = 16


def make_inputs(args: argparse.Namespace) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_req = -(-args.context // BLOCK_SIZE)
    num_blocks = args.batch * blocks_per_req + 1
    pool = torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1
    block_tables = pool.view(args.batch, blocks_per_req).to(torch.int32)
    kv_cache = torch.randn(
        2, num_blocks, BLOCK_SIZE, args.num_kv_heads, args.head_dim,
        device="cuda", dtype=torch.bfloat16, generator=gen,
    )  # fmt: skip
    query = torch.randn(
        args.batch, args.num_heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
        generator=gen,
    )  # fmt: skip
    return {
        "query": query,
        "kv_cache": kv_cache,
        "block_tables": block_tables,
        "query_start_loc": torch.arange(args.batch + 1, device="cuda", dtype=torch.int32),
        "seq_lens": torch.full((args.batch,), args.context, device="cuda", dtype=torch.int32),
        "max_query_len": 1,
        "scale": args.head_dim**-0.5,
        "out": torch.empty_like(query),
    }


def time_us(inputs: dict, config: dict, iters: int) -> float:
    return launches_ms(lambda: paged_attention_unified(**inputs, **config), iters, 3) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--num-heads", type=int, default=16)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    inputs = make_inputs(args)
    kv_bytes = 2 * args.batch * args.context * args.num_kv_heads * args.head_dim * 2
    configs = [{}] + [
        {"block_n": n, "num_warps": w, "num_stages": s}
        for n, w, s in itertools.product((32, 64, 128, 256), (1, 2, 4, 8), (1, 2, 3, 4))
    ]
    results = []
    for config in configs:
        try:
            us = time_us(inputs, config, args.iters)
        except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
            print(f"skip {config}: {type(exc).__name__}")
            continue
        results.append({"config": config, "us": us, "gbps": kv_bytes / us / 1e3})
        print(f"{us:9.1f} us {kv_bytes / us / 1e3:7.0f} GB/s  {config or 'default'}", flush=True)
    best = min(results, key=lambda r: r["us"])
    print(f"best: {best['config']} {best['us']:.1f} us ({results[0]['us']:.1f} us default)")
    if args.out is not None:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "results": results}, indent=2)
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
