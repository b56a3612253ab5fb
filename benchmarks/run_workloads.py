"""Runs the `lat`, `c16`, `c64` and `nano` workloads of BENCHMARKS.md (and, when named: `prefix`,
the prefix-cache TTFT; `long`, 32 prompts of 4,000 tokens with 128 out each, the long-prompt row;
`decode8k`, the decode rate of 32 requests at 8,000 tokens of context, FP8 KV's row; `turn16`
and `turn64`, the next turn of many conversations after their cached history) on one model config.

Random ("dummy") weights of the config's shapes, token-id prompts, `ignore_eos`, one engine in
this process. Writes one JSON with every figure and the environment; the file is rewritten after
each workload, so a run cut short keeps what it finished. The workloads themselves:
benchmarks/workload_runs.py. Usage: see benchmarks/README.md.
"""

import time

# Start-up is measured from here: before torch or ferrum is imported.
_PROCESS_START = time.perf_counter()

# ruff: noqa: E402
import argparse
import dataclasses
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

import torch

import ferrum
from benchmarks.workload_runs import (
    TURNS,
    run_decode_at_context,
    run_lat,
    run_prefix,
    run_repeated,
    run_throughput,
    run_turn,
    synchronize,
    throughput_warmup,
)
from ferrum.engine.arg_utils import EngineArgs
from ferrum.entrypoints.llm import LLM

WORKLOADS = ("lat", "c16", "c64", "nano", "prefix", "long", "decode8k", "turn16", "turn64")
# The BENCHMARKS.md runs; the others run when named.
DEFAULT_WORKLOADS = WORKLOADS[:4]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Run the BENCHMARKS.md workloads with dummy weights and write one JSON."
    )
    EngineArgs.add_cli_args(parser, model_positional=False)
    parser.set_defaults(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated, from {WORKLOADS}",
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="multiply every token and prompt count (tiny CPU runs: 0.02; nano lengths >= 100)",
    )
    parser.add_argument("--lat-iters", type=int, default=5, help="timed repetitions of lat")
    parser.add_argument("--lat-warmup", type=int, default=2, help="untimed repetitions of lat")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each c16/c64/nano/long workload, repeat r > 0 on prompts of its own seed "
        "(sharing no prefix with any other prompt of this script); the workload's figures stay "
        "those of repeat 0, and the JSON adds every repeat's output tok/s and their median",
    )
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("--model is required (a folder with config.json, e.g. benchmarks/models/...)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        names = _check_args(args)
    except ValueError as e:
        print(f"run_workloads: error: {e}", file=sys.stderr)
        return 2
    engine_args = EngineArgs.from_cli_args(args, args.model)
    init_start = time.perf_counter()
    llm = LLM(**vars(engine_args))
    synchronize(llm)
    ready = time.perf_counter()
    report: dict[str, Any] = {
        "model": args.model,
        "model_name": Path(args.model).name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **environment(llm),
        "engine_args": dataclasses.asdict(engine_args),
        "scale": args.scale,
        "startup_s": ready - _PROCESS_START,
        "engine_init_s": ready - init_start,
        "workloads": {},
    }
    _write(args.out, report)
    print(f"engine ready: start-up {report['startup_s']:.2f} s", flush=True)
    vocab_size = llm.llm_engine.config.model_config.vocab_size
    warmed_up = False
    for name in names:
        if name not in ("lat", "prefix") and not warmed_up:
            report["throughput_warmup_s"] = throughput_warmup(llm, vocab_size, args.scale)
            warmed_up = True
        start = time.perf_counter()
        if name == "lat":
            figures = run_lat(llm, vocab_size, args.scale, args.lat_warmup, args.lat_iters)
        elif name == "prefix":
            figures = run_prefix(llm, vocab_size, args.scale, args.lat_warmup, args.lat_iters)
        elif name == "decode8k":
            figures = run_decode_at_context(llm, vocab_size, args.scale)
        elif name in TURNS:
            figures = run_repeated(
                lambda repeat, name=name: run_turn(llm, name, vocab_size, args.scale, repeat),
                args.repeats,
            )
        else:
            figures = run_repeated(
                lambda repeat, name=name: run_throughput(
                    llm, name, vocab_size, args.scale, engine_args.seed, repeat
                ),
                args.repeats,
            )
        figures["wall_s"] = time.perf_counter() - start
        report["workloads"][name] = figures
        _write(args.out, report)
        print(f"{name}: {_summary(name, figures)}", flush=True)
    report["total_s"] = time.perf_counter() - _PROCESS_START
    _write(args.out, report)
    print(f"wrote {args.out}", flush=True)
    return 0


def environment(llm: LLM) -> dict[str, Any]:
    device = llm.llm_engine.config.device_config.device
    if device.startswith("cuda"):
        device_name = torch.cuda.get_device_name(torch.device(device))
    else:
        device_name = platform.processor() or platform.machine() or "cpu"
    return {
        "device": device,
        "device_name": device_name,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "ferrum_version": ferrum.__version__,
        "python_version": platform.python_version(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": _git_dirty(),
        "hostname": platform.node(),
    }


def _check_args(args: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if not names or unknown:
        raise ValueError(
            f"workloads must be a comma-separated subset of {WORKLOADS}, got {args.workloads!r}"
        )
    if not 0.0 < args.scale <= 1.0:
        raise ValueError(f"scale must be in (0, 1], got {args.scale}")
    if args.lat_iters < 1:
        raise ValueError(f"lat_iters must be >= 1, got {args.lat_iters}")
    if args.lat_warmup < 0:
        raise ValueError(f"lat_warmup must be >= 0, got {args.lat_warmup}")
    if not 1 <= args.repeats <= 1000:
        raise ValueError(f"repeats must be in [1, 1000] (seeds per workload), got {args.repeats}")
    return names


def _summary(name: str, figures: dict[str, Any]) -> str:
    if name == "lat":
        return f"TTFT {figures['ttft_ms']:.2f} ms, TPOT {figures['tpot_ms']:.3f} ms"
    if name == "decode8k":
        return (
            f"{figures['decode_tokens_per_second']:.0f} decode tok/s "
            f"({figures['decode_step_ms']:.2f} ms a step)"
        )
    if name == "prefix":
        return (
            f"TTFT cold {figures['cold_ttft_ms']:.2f} ms, hit {figures['hit_ttft_ms']:.2f} ms "
            f"({figures['speedup']:.1f}x)"
        )
    summary = (
        f"{figures['output_tokens_per_second']:.0f} output tok/s ({figures['elapsed_time']:.2f} s)"
    )
    if "median_output_tokens_per_second" in figures:
        rates = ", ".join(f"{r:.0f}" for r in figures["repeats_output_tokens_per_second"])
        summary += f"; repeats {rates}, median {figures['median_output_tokens_per_second']:.0f}"
    return summary


def _git(*command: str) -> str | None:
    try:
        result = subprocess.run(
            ["git", *command], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def _git_dirty() -> bool | None:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def _write(path: str, report: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
