"""Times FP8 linear layers against bf16 at Qwen3-8B shapes: Triton block-scale, per-channel.

Each row is one linear x [M, K] bf16 -> [M, N] bf16 including its activation quantization:
  bf16_mm            torch.nn.functional.linear on a bf16 weight
  block_linear       ferrum fp8_block_linear as shipped (fp8_gemm_configs/, else the defaults)
  block_triton       ferrum fp8_block_linear with every bucket but the GEMV's on Triton
  block_scaled_mm    group quantization + F.scaled_mm BlockWise1x128 x BlockWise128x128 (cuBLASLt;
                     recorded as unsupported where this torch/CUDA build refuses it)
  channel_scaled_mm  per-token quantization + torch._scaled_mm row-wise (cuBLASLt)
  channel_triton     ferrum fp8_channel_linear with every bucket but the GEMV's on Triton
  block_gemv         ferrum fp8_gemv, block scales, GEMV_CONFIG's tile (rows with M <= 16 only)
  channel_gemv       ferrum fp8_gemv, per-channel scales, GEMV_CONFIG's tile (M <= 16 only)
Each timing replays a CUDA graph of --iters calls (the engine runs decode in graphs, so launch
overhead is left out) over enough weight copies to exceed the L2 cache; prints microseconds,
TFLOP/s (2MNK) and GB/s (weight + activation + output bytes).
--sweep times a grid of Triton tiles (split-K included) and, for block scales on Hopper, of the
wgmma GEMM's tiles (--sweep-backends) per shape, M and format (--formats) and prints the best;
--save DIR writes the tuned buckets of each shape with the swept M's replaced (`merged_bucket`:
by cuBLASLt, backend scaled_mm, where it was faster; for block scales, left as they were where
the layer as shipped in fp8_gemm_configs/ was faster). --gemv-sweep times a grid of GEMV tiles
at each M <= 16 and prints the best per shape, M and format.
Usage: python benchmarks/bench_fp8_gemm.py [--m 1,8,64,256,2048,8192] [--sweep [--save DIR]]
       [--gemv-sweep [--formats block,channel] [--save-gemv DIR]] [--out file.json]
"""

# ruff: noqa: E402
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from benchmarks.fp8_bucket_merge import base_buckets, merged_bucket
from benchmarks.fp8_gemm_sweep import gemv_fn, run_gemv_sweep, run_sweep
from benchmarks.gpu_timing import graph_us
from ferrum.kernels.fp8_gemm_config import (
    DEFAULT_BUCKETS,
    SCALE_FORMATS,
    Fp8GemmConfig,
    pick,
    save_buckets,
)
from ferrum.kernels.fp8_linear import fp8_block_linear, fp8_channel_linear
from ferrum.kernels.fp8_quant import per_token_group_quant_fp8, per_token_quant_fp8
from ferrum.kernels.fp8_weight import quantize_weight_block, quantize_weight_per_channel

QWEN3_8B = "qkv:6144x4096,o:4096x4096,gate_up:24576x4096,down:4096x12288"
L2_FLUSH_BYTES = 256 << 20
MAX_COPIES = 16
GEMV_MAX_M = 16
GEMV_CONFIG = Fp8GemmConfig("gemv", BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=2)


@dataclasses.dataclass
class Weights:
    """Copies of one weight in every format, cycled so that the timed calls stream from HBM."""

    bf16: list[torch.Tensor]
    block: list[tuple[torch.Tensor, torch.Tensor]]
    channel: list[tuple[torch.Tensor, torch.Tensor]]


def make_weights(n: int, k: int) -> Weights:
    copies = max(1, min(MAX_COPIES, -(-L2_FLUSH_BYTES // (n * k))))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    block, channel = quantize_weight_block(w), quantize_weight_per_channel(w)
    return Weights(
        bf16=[w.clone() for _ in range(copies)],
        block=[(block[0].clone(), block[1].clone()) for _ in range(copies)],
        channel=[(channel[0].clone(), channel[1].clone()) for _ in range(copies)],
    )


def block_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """cuBLASLt block-scaled GEMM: M padded to 4, scales outer-dim-major, K blocks padded to 4."""
    m = x.shape[0]
    xp = F.pad(x, (0, 0, 0, -m % 4)) if m % 4 else x
    q, scales = per_token_group_quant_fp8(xp)
    kb = scales.shape[1]
    w_scale = F.pad(scale_inv, (0, -kb % 4)) if kb % 4 else scale_inv
    out = F.scaled_mm(
        q,
        weight.t(),
        scales.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        w_scale.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )
    return out[:m]


def channel_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q, scales = per_token_quant_fp8(x)
    return torch._scaled_mm(
        q, weight.t(), scale_a=scales, scale_b=scale.view(1, -1), out_dtype=x.dtype
    )


def row_fns(x: torch.Tensor, w: Weights) -> dict:
    triton_channel, triton_block = (
        {
            b: dataclasses.replace(c, backend="triton")
            for b, c in DEFAULT_BUCKETS[fmt].items()
            if c.backend != "gemv"
        }
        for fmt in ("channel", "block")
    )
    gemv = {}
    if x.shape[0] <= GEMV_MAX_M:
        gemv = {
            "block_gemv": lambda i: gemv_fn(x, w, "block", GEMV_CONFIG)(i),
            "channel_gemv": lambda i: gemv_fn(x, w, "channel", GEMV_CONFIG)(i),
        }
    return gemv | {
        "bf16_mm": lambda i: F.linear(x, w.bf16[i]),
        "block_linear": lambda i: fp8_block_linear(x, *w.block[i]),
        "block_triton": lambda i: fp8_block_linear(x, *w.block[i], buckets=triton_block),
        "block_scaled_mm": lambda i: block_scaled_mm(x, *w.block[i]),
        "channel_scaled_mm": lambda i: channel_scaled_mm(x, *w.channel[i]),
        "channel_triton": lambda i: fp8_channel_linear(x, *w.channel[i], buckets=triton_channel),
    }


def check_outputs(x: torch.Tensor, w: Weights) -> dict[str, float]:
    """Each FP8 row's max abs error against the bf16 product, relative to its abs-max."""
    ref = F.linear(x, w.bf16[0]).float()
    errors = {}
    for name, fn in row_fns(x, w).items():
        try:
            errors[name] = ((fn(0).float() - ref).abs().max() / ref.abs().max()).item()
        except Exception as exc:  # an unsupported cuBLASLt path
            errors[name] = float("nan")
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:160]}")
    return errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=QWEN3_8B, help="name:NxK,... (out x in features)")
    parser.add_argument("--m", default="1,8,64,256,2048,8192")
    parser.add_argument("--iters", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--save",
        type=Path,
        default=None,
        help="with --sweep: per shape and format, write DIR/ config files: DIR's file of the "
        "shape (else fp8_gemm_configs/'s, else the defaults) with each swept M's bucket replaced "
        "by the sweep's best tile, or by cuBLASLt where that was faster; GEMV buckets are kept, "
        "and block buckets where the layer as shipped was faster",
    )
    parser.add_argument(
        "--sweep-backends",
        default="triton,wgmma",
        help="with --sweep: which kernels' tiles to time (triton, wgmma: block scales, Hopper)",
    )
    parser.add_argument("--gemv-sweep", action="store_true", help="grid of GEMV tiles, M <= 16")
    parser.add_argument("--formats", default="block,channel", help="scale formats to sweep")
    parser.add_argument(
        "--save-gemv",
        type=Path,
        default=None,
        help="with --gemv-sweep: per shape and format, write DIR/ config files: the default "
        "buckets plus a GEMV bucket at each M where the GEMV beat the other FP8 rows",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    formats = args.formats.split(",")
    if not set(formats) <= set(SCALE_FORMATS):
        parser.error(f"--formats must be among {SCALE_FORMATS}, got {args.formats!r}")
    backends = tuple(args.sweep_backends.split(","))
    if not set(backends) <= {"triton", "wgmma"}:
        parser.error(f"--sweep-backends must be among triton, wgmma, got {args.sweep_backends!r}")
    if args.save is not None and not args.sweep:
        parser.error("--save needs --sweep")
    if args.save_gemv is not None and not args.gemv_sweep:
        parser.error("--save-gemv needs --gemv-sweep")
    shapes = [
        (name, *map(int, nk.split("x")))
        for name, nk in (s.split(":") for s in args.shapes.split(","))
    ]
    ms = [int(m) for m in args.m.split(",")]
    device_name = torch.cuda.get_device_name()
    results = []
    print(f"{device_name}, torch {torch.__version__}, timings: CUDA graph of {args.iters} calls")
    for name, n, k in shapes:
        weights = make_weights(n, k)
        tuned: dict[str, dict] = {"block": {}, "channel": {}}
        gemv_wins: dict[str, dict[int, dict]] = {}
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            errors = check_outputs(x, weights)
            bytes_fp8, bytes_bf16 = n * k + 4 * m * k, 2 * n * k + 4 * m * k
            row = {"shape": name, "N": n, "K": k, "M": m, "rows": {}}
            for rname, fn in row_fns(x, weights).items():
                if errors[rname] != errors[rname]:  # nan: the path raised
                    row["rows"][rname] = {"unsupported": True}
                    continue
                us = graph_us(fn, len(weights.bf16), args.iters)
                nbytes = bytes_bf16 if rname == "bf16_mm" else bytes_fp8
                row["rows"][rname] = {
                    "us": us, "tflops": 2 * m * n * k / us / 1e6, "gbps": nbytes / us / 1e3,
                    "rel_err_vs_bf16": errors[rname],
                }  # fmt: skip
                print(
                    f"{name:8s} N={n:6d} K={k:6d} M={m:5d} {rname:18s} {us:9.1f} us "
                    f"{2 * m * n * k / us / 1e6:7.1f} TFLOP/s {nbytes / us / 1e3:7.0f} GB/s "
                    f"err {errors[rname]:.1e}",
                    flush=True,
                )
            if args.gemv_sweep and m <= GEMV_MAX_M:
                for fmt in formats:
                    best = run_gemv_sweep(x, weights, fmt, args.iters)
                    row[f"gemv_sweep_{fmt}"] = best
                    print(f"  gemv sweep {fmt}: {best}", flush=True)
                    # cuBLASLt and the Triton GEMM: at M = 1 the *_linear rows run a GEMV too.
                    others = [
                        row["rows"][rname]["us"]
                        for rname in (f"{fmt}_scaled_mm", f"{fmt}_triton")
                        if "us" in row["rows"].get(rname, {})
                    ]
                    if best and others and best["us"] < min(others):
                        gemv_wins.setdefault(fmt, {})[m] = best["config"]
            if args.sweep:
                for fmt in formats:
                    t0 = time.perf_counter()
                    best = run_sweep(x, weights, fmt, args.iters, backends)
                    row[f"sweep_{fmt}"] = best
                    tuned[fmt][m] = best
                    print(f"  sweep {fmt}: {best} ({time.perf_counter() - t0:.0f} s)", flush=True)
            results.append(row)
        if args.save is not None:
            for fmt, per_m in tuned.items():
                buckets = base_buckets(fmt, n, k, device_name, args.save)
                for m, best in per_m.items():
                    if not best:
                        continue
                    row = next(r for r in results if r["shape"] == name and r["M"] == m)
                    config = merged_bucket(
                        buckets.get(m),
                        best,
                        row["rows"].get(f"{fmt}_scaled_mm", {}).get("us"),
                        row["rows"].get(f"{fmt}_linear", {}).get("us"),
                        pick(DEFAULT_BUCKETS[fmt], m),
                    )
                    if config is None:
                        print(f"  left the buckets of {name} {fmt} at {m} rows as they were")
                    else:
                        buckets[m] = config
                if any(per_m.values()):
                    path = save_buckets(
                        fmt, n, k, device_name, dict(sorted(buckets.items())), args.save
                    )
                    print(f"saved {path}")
        if args.save_gemv is not None:
            for fmt, per_m in gemv_wins.items():
                buckets = base_buckets(fmt, n, k, device_name, args.save_gemv)
                buckets.update({m: Fp8GemmConfig(**c) for m, c in per_m.items()})
                buckets = dict(sorted(buckets.items()))
                path = save_buckets(fmt, n, k, device_name, buckets, args.save_gemv)
                print(f"saved {path}")
        del weights
        torch.cuda.empty_cache()
    if args.out is not None:
        arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        meta = {"device": device_name, "torch": torch.__version__, "args": arguments}
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
