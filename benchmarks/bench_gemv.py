"""One-row linear layers in bf16: torch's F.linear (cuBLAS) against ferrum's Triton GEMV.

The shapes are each model's linear layers at one activation row (batch-1 decode): qkv, o,
gate_up and down (dense MLPs only) and the LM head, from `--models` configs. Each timing replays a
CUDA graph of --iters calls over enough weight copies to exceed the L2 cache (the engine decodes
in graphs); prints microseconds and the weight bytes read per second. --sweep times a grid of
GEMV tiles per shape and prints the best; --save writes ferrum/kernels/gemv_configs/<device>.json
with the shapes where that tile beat F.linear by more than --min-gain (only those take the GEMV).
--rows M times M activation rows (a verify step's, a small batch's): F.linear, the GEMV with one
row a program, and with the M rows sharing each program's reads of W (`gemv_shared_us`, which
--sweep then tunes; the engine takes this GEMV only at one row, so --save needs --rows 1;
bench_gemv_rows.py measures and tunes the few-row kernel the engine takes at 2-16 rows).

    python benchmarks/bench_gemv.py \
        --models benchmarks/models/qwen3-8b,benchmarks/models/qwen3-0.6b \
        --sweep --save --out $OUT/gemv.json
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

from benchmarks.gpu_timing import graph_us
from ferrum.kernels.gemv import gemv
from ferrum.kernels.gemv_config import GemvTile, get_gemv_tiles, save_gemv_tiles

L2_FLUSH_BYTES = 256 << 20
MAX_COPIES = 16
SWEEP = {
    "BLOCK_N": (1, 2, 4, 8, 16),
    "BLOCK_K": (512, 1024, 2048, 4096),
    "num_warps": (2, 4, 8),
    "num_stages": (1, 2, 3),
}


def model_shapes(config_path: Path) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each one-row linear layer of the model (no tensor parallelism)."""
    cfg = json.loads(config_path.read_text())
    cfg = cfg.get("text_config", cfg)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    shapes = {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "lm_head": (cfg["vocab_size"], hidden),
    }
    if cfg.get("num_experts"):
        shapes["router"] = (cfg["num_experts"], hidden)
    else:
        shapes["gate_up"] = (2 * cfg["intermediate_size"], hidden)
        shapes["down"] = (hidden, cfg["intermediate_size"])
    return shapes


def add_grid_flags(parser: argparse.ArgumentParser, grid: dict, when: str = "") -> None:
    """A --block-n style flag per tile field of `grid` (comma-separated values; dest: the
    field's name)."""
    for name, values in grid.items():
        parser.add_argument(
            f"--{name.lower().replace('_', '-')}",
            dest=name,
            type=lambda text: tuple(int(v) for v in text.split(",")),
            default=values,
            help=f"{when}comma-separated {name} values (default {values})",
        )


def collect_shapes(
    parser: argparse.ArgumentParser, models: str, only: str | None
) -> dict[tuple[int, int], list[str]]:
    """(N, K) -> the "model:layer" names of the comma-separated model folders' linear layers
    (`only`: these layer names); a parser error when none is left."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for folder in models.split(","):
        for name, nk in model_shapes(Path(folder) / "config.json").items():
            if only is None or name in only.split(","):
                shapes.setdefault(nk, []).append(f"{Path(folder).name}:{name}")
    if not shapes:
        parser.error(f"--only {only}: no such layer (qkv, o, gate_up, down, lm_head, router)")
    return shapes


def gemv_fn(x: torch.Tensor, weights: list[torch.Tensor], tile: GemvTile, rows: int = 1):
    tiles = (tile.BLOCK_N, tile.BLOCK_K, tile.num_warps, tile.num_stages)
    return lambda i: gemv(x, weights[i], *tiles, rows_per_program=rows)


def shared_rows(m: int) -> int:
    """Rows a program takes when the M rows share its reads of W."""
    return min(16, 1 << (m - 1).bit_length())


def sweep(x: torch.Tensor, weights: list[torch.Tensor], iters: int, grid: dict) -> dict:
    best: dict = {}
    for values in itertools.product(*grid.values()):
        tile = GemvTile(**dict(zip(grid, values)))
        try:
            fn = gemv_fn(x, weights, tile, shared_rows(x.shape[0]))
            us = graph_us(fn, len(weights), iters)
        except Exception as exc:  # a tile the compiler rejects
            print(f"    skip {tile}: {type(exc).__name__}")
            continue
        if not best or us < best["us"]:
            best = {"us": us, "tile": dataclasses.asdict(tile)}
    return best


def tb_per_s(n: int, k: int, us: float) -> float:
    return 2 * n * k / us / 1e6


def measure_shape(
    n: int, k: int, tile: GemvTile, grid: dict | None, iters: int, m: int = 1
) -> dict:
    """F.linear and the GEMV (`tile`, and the sweep's best) at m rows of a bf16 [n, k] weight."""
    copies = max(1, min(MAX_COPIES, -(-L2_FLUSH_BYTES // (2 * n * k))))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    weights = [w.clone() for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x.float(), w.float())
    got = gemv(x, w, *dataclasses.astuple(tile)).float()
    row: dict = {
        "N": n,
        "K": k,
        "weight_bytes": 2 * n * k,
        "f_linear_us": graph_us(lambda i: F.linear(x, weights[i]), copies, iters),
        "gemv_max_abs_err": (got - expected).abs().max().item(),
        "gemv_us": graph_us(gemv_fn(x, weights, tile), copies, iters),
        "gemv_tile": dataclasses.asdict(tile),
        "rows": m,
    }
    if m > 1:
        shared = gemv_fn(x, weights, tile, shared_rows(m))
        row["gemv_shared_us"] = graph_us(shared, copies, iters)
    if grid is not None:
        row["sweep"] = sweep(x, weights, iters, grid)
        if row["sweep"]:
            best = GemvTile(**row["sweep"]["tile"])
            got = gemv(x, w, *dataclasses.astuple(best), rows_per_program=shared_rows(m)).float()
            row["sweep"]["max_abs_err"] = (got - expected).abs().max().item()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default="benchmarks/models/qwen3-8b",
        help="comma-separated model folders (their config.json gives the shapes)",
    )
    parser.add_argument(
        "--only", default=None, help="comma-separated layer names to measure (e.g. router)"
    )
    parser.add_argument("--iters", type=int, default=50, help="calls per CUDA graph")
    parser.add_argument("--sweep", action="store_true")
    add_grid_flags(parser, SWEEP, "with --sweep: ")
    parser.add_argument("--save", action="store_true", help="with --sweep: write the winners")
    parser.add_argument(
        "--min-gain", type=float, default=0.03, help="--save: the GEMV must be this much faster"
    )
    parser.add_argument("--rows", type=int, default=1, help="activation rows (1: batch-1 decode)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.save and not args.sweep:
        parser.error("--save needs --sweep")
    if args.save and args.rows != 1:
        parser.error("--save needs --rows 1 (the table is the one-row GEMV's)")
    grid = {name: getattr(args, name) for name in SWEEP}
    if grid != SWEEP and not args.sweep:
        parser.error("the tile grid flags (--block-n, ...) need --sweep")
    device_name = torch.cuda.get_device_name()
    print(f"{device_name}, torch {torch.__version__}, timings: CUDA graph of {args.iters} calls")
    shapes = collect_shapes(parser, args.models, args.only)
    tuned = get_gemv_tiles(device_name)
    results, winners = [], {}
    for (n, k), names in shapes.items():
        tile = tuned.get((n, k), GemvTile(8, 512))
        row = measure_shape(n, k, tile, grid if args.sweep else None, args.iters, args.rows)
        row["shapes"] = names
        best = row.get("sweep", {})
        if best and best["us"] * (1 + args.min_gain) < row["f_linear_us"]:
            winners[n, k] = GemvTile(**best["tile"])
        best_us = best.get("us", row["gemv_us"])
        print(
            f"{','.join(names):40s} N={n:6d} K={k:6d} F.linear {row['f_linear_us']:7.1f} us "
            f"({tb_per_s(n, k, row['f_linear_us']):.2f} TB/s)  gemv {row['gemv_us']:7.1f} us  "
            f"best {best_us:7.1f} us ({tb_per_s(n, k, best_us):.2f} TB/s) {best.get('tile', '')}"
            f"  shared rows {row.get('gemv_shared_us', float('nan')):7.1f} us"
            f"  err {row['gemv_max_abs_err']:.1e}",
            flush=True,
        )
        results.append(row)
        torch.cuda.empty_cache()
    if args.save:
        losers = frozenset(shapes) - frozenset(winners)
        path = save_gemv_tiles(device_name, winners, drop=losers)
        print(f"saved {path} ({len(winners)} shapes; {len(losers)} marked null: F.linear)")
    if args.out is not None:
        payload = {"device": device_name, "torch": torch.__version__, "results": results}
        args.out.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
