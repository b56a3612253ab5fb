"""Times the Triton fused MoE over a grid of tile configs per token count, at Qwen3-30B-A3B shapes.

Prints, for each token count, the default config's time, the best config and its time, and the
time the active experts' weights take to stream at HBM bandwidth. Times are CUDA events around
eager calls (median of repeats), so small token counts include launch gaps that CUDA graphs hide:
confirm a config change with the end-to-end `lat` workload.
Usage: python benchmarks/tune_fused_moe.py [--tokens 16,64,256]
    [--save ferrum/kernels/fused_moe_configs]
"""

# ruff: noqa: E402
import argparse
import functools
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ferrum.kernels.fused_moe import fused_moe, get_config
from ferrum.kernels.fused_moe_config import save_section


def time_ms(fn, iters: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,4,16,64,256")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument(
        "--save",
        type=Path,
        default=None,
        help="write each token count's best config as the 'grouped' section of this shape's "
        "tuned file in this folder (ferrum/kernels/fused_moe_configs to use it)",
    )
    args = parser.parse_args()
    e, k, h, i = args.experts, args.top_k, args.hidden, args.intermediate
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    grid = [
        {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": bk, "num_warps": w, "num_stages": s}
        for m, n, bk, w, s in itertools.product(
            (16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4)
        )
    ]
    bytes_per_expert = (w13[0].numel() + w2[0].numel()) * 2
    best_configs: dict[int, dict[str, int]] = {}
    for t in (int(x) for x in args.tokens.split(",")):
        hidden = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen)
        logits = torch.randn(t, e, device=dev, generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), k, -1)
        active = len(torch.unique(ids))
        run = functools.partial(fused_moe, hidden, w13, w2, weights, ids, small_batch_max_tokens=0)
        default = time_ms(run)
        results = []
        for config in grid:
            if config["BLOCK_M"] > max(16, 4 * t * k):
                continue
            try:
                ms = time_ms(functools.partial(run, config=config), 10)
            except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
                print(f"  skip {config}: {type(exc).__name__}")
                continue
            results.append((ms, config))
        results.sort(key=lambda r: r[0])
        best_ms, best = results[0]
        best_configs[t] = best
        roofline_ms = active * bytes_per_expert / 3.35e12 * 1e3
        print(
            f"T={t}: default {get_config(t)} {default * 1e3:.1f} us | best {best} "
            f"{best_ms * 1e3:.1f} us | weights of {active} experts at 3.35 TB/s "
            f"{roofline_ms * 1e3:.1f} us",
            flush=True,
        )
    if args.save is not None:
        device_name = torch.cuda.get_device_name()
        path = save_section(e, i, h, device_name, "grouped", best_configs, args.save)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
