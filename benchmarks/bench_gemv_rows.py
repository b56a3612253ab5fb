"""Few-row linear layers in bf16 (a speculative verify step's rows, a small decode batch's):
torch's F.linear (cuBLAS) against ferrum's few-row Triton kernel (kernels/gemv_rows.py).

The shapes are each model's linear layers (bench_gemv.model_shapes) at each of --rows row counts.
Each timing replays a CUDA graph over weight copies larger than L2 (bench_gemv's timer), and
prints microseconds and the weight bytes read per second. Every tile of the grid (--block-n,
--block-k, --split-k, --num-warps, --num-stages) is first checked against F.linear in fp32 (a
tile off by more than 1% of the output's largest value is skipped), then timed per shape and row
count, and the best is printed; --save writes ferrum/kernels/gemv_rows_configs/<device>.json
entries (the row count's bucket, gemv_rows_config.row_bucket): the best tile where it beat
F.linear by more than --min-gain, else null (cuBLAS), as `ferrum tune --ops gemv_rows` does.

    python benchmarks/bench_gemv_rows.py --models benchmarks/models/qwen3-8b --rows 2,4,8,16 \
        --save --out $OUT/gemv_rows.json
"""

# ruff: noqa: E402
import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from benchmarks.bench_gemv import (
    L2_FLUSH_BYTES,
    MAX_COPIES,
    add_grid_flags,
    collect_shapes,
    tb_per_s,
)
from benchmarks.gpu_timing import graph_us
from ferrum.bench.tune_ops import GEMV_ROWS_SPACE
from ferrum.kernels.gemv_rows import GemvRowsTile, gemv_rows
from ferrum.kernels.gemv_rows_config import row_bucket, save_gemv_rows_tiles

# ferrum tune's space, each dimension a flag to narrow it.
GRID = GEMV_ROWS_SPACE


def measure(n: int, k: int, m: int, grid: dict, iters: int) -> dict:
    """F.linear and every tile of `grid` at m rows of a bf16 [n, k] weight."""
    copies = max(1, min(MAX_COPIES, -(-L2_FLUSH_BYTES // (2 * n * k))))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    weights = [w.clone() for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x.float(), w.float())
    row: dict = {"N": n, "K": k, "rows": m, "weight_bytes": 2 * n * k}
    row["f_linear_us"] = graph_us(lambda i: F.linear(x, weights[i]), copies, iters)
    tolerance = 0.01 * expected.abs().max().item()
    best: dict = {}
    for values in itertools.product(*grid.values()):
        tile = GemvRowsTile(**dict(zip(grid, values)))
        try:
            err = (gemv_rows(x, w, tile).float() - expected).abs().max().item()
            if not err <= tolerance:
                print(f"    wrong {tile}: max abs error {err:.3g} > {tolerance:.3g}")
                continue
            us = graph_us(lambda i, t=tile: gemv_rows(x, weights[i], t), copies, iters)
        except Exception as exc:  # a tile the compiler or the GPU's shared memory rejects
            print(f"    skip {tile}: {type(exc).__name__}")
            continue
        if not best or us < best["us"]:
            best = {"us": us, "tile": dataclasses.asdict(tile), "max_abs_err": err}
    row["best"] = best
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="benchmarks/models/qwen3-8b")
    parser.add_argument("--only", default=None, help="comma-separated layer names (e.g. qkv,o)")
    parser.add_argument("--rows", default="2,4,8,16", help="comma-separated row counts")
    parser.add_argument("--iters", type=int, default=30, help="calls per CUDA graph")
    add_grid_flags(parser, GRID)
    parser.add_argument("--save", action="store_true", help="write the winners' table entries")
    parser.add_argument(
        "--min-gain", type=float, default=0.03, help="--save: the kernel must be this much faster"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    try:
        row_counts = [int(v) for v in args.rows.split(",")]
        for m in row_counts:
            row_bucket(m)
    except ValueError as e:
        parser.error(f"--rows: {e}")
    grid = {name: getattr(args, name) for name in GRID}
    device_name = torch.cuda.get_device_name()
    print(f"{device_name}, torch {torch.__version__}, timings: CUDA graph of {args.iters} calls")
    shapes = collect_shapes(parser, args.models, args.only)
    results: list[dict] = []
    winners: dict[tuple[int, int, int], GemvRowsTile | None] = {}
    for m in row_counts:
        for (n, k), names in shapes.items():
            row = measure(n, k, m, grid, args.iters)
            row["shapes"] = names
            best = row["best"]
            wins = best and best["us"] * (1 + args.min_gain) < row["f_linear_us"]
            winners[n, k, row_bucket(m)] = GemvRowsTile(**best["tile"]) if wins else None
            print(
                f"rows {m:2d} {','.join(names):32s} N={n:6d} K={k:6d} "
                f"F.linear {row['f_linear_us']:7.1f} us "
                f"({tb_per_s(n, k, row['f_linear_us']):.2f} TB/s)  best "
                f"{best.get('us', float('nan')):7.1f} us "
                f"({tb_per_s(n, k, best.get('us', float('nan'))):.2f} TB/s) {best.get('tile', '')}",
                flush=True,
            )
            results.append(row)
            torch.cuda.empty_cache()
    if args.save:
        path = save_gemv_rows_tiles(device_name, winners)
        faster = sum(tile is not None for tile in winners.values())
        print(f"saved {path} ({faster} of {len(winners)} entries faster than F.linear)")
    if args.out is not None:
        payload = {"device": device_name, "torch": torch.__version__, "results": results}
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
