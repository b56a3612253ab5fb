"""Times, on the current GPU, each op's tile from the default rule against the tile its tuned
table gives (the user's folder, then ferrum/kernels/*_configs), per shape and batch bucket, and
prints rule/table ratios: how far the untuned default is from tuned (issue 37 asks <= 1.10),
beside the time the call's bytes take at the GPU's HBM bandwidth (the bound of small batches).

Ops and shapes: bf16 one-row GEMV and FP8 linear (block scales) at the models' linear shapes;
the fused MoE (bf16 and FP8 experts; grouped and small-batch) at their MoE shapes. Timing is
`ferrum tune`'s (ferrum/bench/tune_gpu.py: a CUDA graph over weight copies, median of replays).
A bucket with no table for this GPU prints "-" for the table (the rule's time alone).
Usage (one command, from the repository root):
  python benchmarks/bench_tile_rule.py [--models benchmarks/models/qwen3-8b,...] [--m 1,16,...]
      [--ops gemv,fp8_gemm,moe_grouped,moe_small] [--tuned-config-dir DIR] [--out file.json]
"""

# ruff: noqa: E402
import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from ferrum import envs
from ferrum.bench.tune_args import OPS
from ferrum.bench.tune_gpu import GpuBench
from ferrum.bench.tune_shapes import (
    LinearShape,
    TuneTask,
    build_tasks,
    lm_head_shape,
    model_shapes,
)
from ferrum.kernels.device_properties import DeviceProperties, device_properties
from ferrum.kernels.fp8_gemm_config import load_tuned_buckets, pick
from ferrum.kernels.fp8_gemm_rule import fp8_gemm_rule
from ferrum.kernels.fused_moe_config import pick as moe_pick
from ferrum.kernels.fused_moe_config import tuned_sections
from ferrum.kernels.fused_moe_rule import grouped_rule, small_rule
from ferrum.kernels.gemv_config import GemvTile, get_gemv_tiles
from ferrum.kernels.tile_rules import gemv_tile_rule
from ferrum.kernels.tuned_tables import set_user_config_dir
from ferrum.model_arch import ModelArchConfig
from ferrum.model_folder import read_hf_config

MODELS = "benchmarks/models/qwen3-8b,benchmarks/models/qwen3-30b-a3b"
DEFAULT_M = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096"
_MISSING = object()


def table_and_rule(task: TuneTask, device: DeviceProperties, user_dir: Path, fp8: bool):
    """(the tuned table's config or _MISSING, the rule's config) of one task."""
    s = task.shape
    if task.op == "gemv":
        tiles = get_gemv_tiles(device.name, user_dir)
        return tiles.get((s.n, s.k), _MISSING), GemvTile(*gemv_tile_rule(s.n, s.k, device))
    if task.op == "fp8_gemm":
        table = load_tuned_buckets("block", s.n, s.k, device.name, user_dir)
        rule = pick(fp8_gemm_rule("block", s.n, s.k, device), task.m)
        return (_MISSING if table is None else pick(table, task.m)), rule
    shape = (s.num_experts, s.inter, s.hidden)
    section = "small" if task.op == "moe_small" else "grouped"
    buckets = tuned_sections(*shape, device.name, fp8).get(section)
    rule_fn = small_rule if section == "small" else grouped_rule
    rule = rule_fn(task.m, *shape, s.top_k, device, fp8)
    return (_MISSING if buckets is None else moe_pick(buckets, task.m)), rule


def roofline_us(task: TuneTask, device: DeviceProperties, fp8: bool) -> float:
    """Microseconds to read the weights the call needs (and its activations, output) at the
    device's HBM bandwidth: the bound of the memory-bound (small batch) rows."""
    s, m = task.shape, task.m
    if isinstance(s, LinearShape):
        weight = s.n * s.k * (1 if task.op == "fp8_gemm" else 2)
        return (weight + 2 * m * (s.n + s.k)) / device.hbm_bandwidth * 1e6
    # Experts a batch of m tokens is expected to touch under uniform routing.
    active = s.num_experts * (1 - (1 - s.top_k / s.num_experts) ** m)
    weight = active * 3 * s.inter * s.hidden * (1 if fp8 else 2)
    return (weight + 4 * m * s.hidden) / device.hbm_bandwidth * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=MODELS, help="comma list of model folders")
    parser.add_argument("--m", default=DEFAULT_M, help="rows (tokens) per bucket, comma list")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma list of {OPS}")
    parser.add_argument("--tuned-config-dir", type=Path, default=None)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_tile_rule.py times kernels on a CUDA GPU; none is visible")
    device = device_properties(torch.device("cuda"))
    user_dir = args.tuned_config_dir or envs.tuned_config_dir()
    set_user_config_dir(user_dir)
    batch_sizes = tuple(sorted({int(m) for m in args.m.split(",")}))
    ops = tuple(args.ops.split(","))
    linear: list[LinearShape] = []
    heads: list[LinearShape] = []
    moe = []
    for folder in args.models.split(","):
        arch = ModelArchConfig.from_hf_config(read_hf_config(folder))
        lin, experts = model_shapes(arch, args.tensor_parallel_size)
        linear += lin
        heads.append(lm_head_shape(arch, args.tensor_parallel_size))
        moe += experts
    linear, moe = list(dict.fromkeys(linear)), list(dict.fromkeys(moe))
    # The GEMV also runs the LM heads; FP8 leaves them unquantized and needs K % 128 == 0.
    shapes = {
        False: list(dict.fromkeys(linear + heads)),
        True: [s for s in linear if s.k % 128 == 0],
    }
    hbm = f"{device.hbm_bandwidth / 1e12:.2f} TB/s"
    print(f"{device.name} ({device.num_sms} SMs, HBM {hbm}): rule vs table ({user_dir}, then "
          "the package), us per call")  # fmt: skip
    print(f"{'op':12s} {'shape':28s} {'M':>5s} {'table':>9s} {'rule':>9s} {'rule/table':>10s} "
          f"{'HBM bound':>9s}")  # fmt: skip
    rows = []
    for fp8 in (False, True):
        bench = GpuBench(device, fp8)
        # bf16: the GEMV and 16-bit experts; FP8: the FP8 linear and FP8 experts.
        wanted = [op for op in ops if op != ("gemv" if fp8 else "fp8_gemm")]
        for task in build_tasks(tuple(wanted), shapes[fp8], moe, batch_sizes):
            table, rule = table_and_rule(task, device, user_dir, fp8)
            rule_us = bench(task, rule)
            table_us = None if table is _MISSING else (
                rule_us if table == rule else bench(task, table)
            )  # fmt: skip
            ratio = None if table_us is None else rule_us / table_us
            op = f"{task.op}{'_fp8' if fp8 and task.op.startswith('moe') else ''}"
            bound = roofline_us(task, device, fp8)
            rows.append({"op": op, "shape": task.shape.key, "m": task.m, "table_us": table_us,
                         "rule_us": rule_us, "ratio": ratio, "hbm_bound_us": bound})  # fmt: skip
            shown = "-" if ratio is None else f"{ratio:.3f}{' !' if ratio > 1.10 else ''}"
            table_text = "-" if table_us is None else f"{table_us:.1f}"
            print(f"{op:12s} {task.shape.key:28s} {task.m:5d} {table_text:>9s} "
                  f"{rule_us:9.1f} {shown:>10s} {bound:9.1f}", flush=True)  # fmt: skip
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    if ratios:
        geomean = math.exp(sum(map(math.log, ratios)) / len(ratios))
        worst = max(rows, key=lambda r: r["ratio"] or 0)
        where = f"{worst['op']} {worst['shape']} M={worst['m']}"
        over = sum(r > 1.10 for r in ratios)
        print(f"{len(ratios)} compared: geomean rule/table {geomean:.3f}, worst "
              f"{worst['ratio']:.3f} ({where}), over 1.10: {over}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"device": device.name, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
