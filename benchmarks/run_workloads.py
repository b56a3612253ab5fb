"""Runs the `lat`, `c16`, `c64` and `nano` workloads of BENCHMARKS.md (and, when named: `prefix`,
the prefix-cache TTFT of issue 18; `long`, 32 prompts of 4,000 tokens with 128 out each, issue 20's
long-prompt row; `decode8k`, the decode rate of 32 requests at 8,000 tokens of context, FP8 KV's
row) on one model config.

Random ("dummy") weights of the config's shapes, token-id prompts, `ignore_eos`, one engine in
this process. Writes one JSON with every figure and the environment; the file is rewritten after
each workload, so a run cut short keeps what it finished. Usage: see benchmarks/README.md.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

import torch

import ferrum
from benchmarks.dummy_engine import start_decoding
from ferrum.bench import workloads
from ferrum.bench.latency import (
    TTFT_SEED_OFFSET,
    measure_latencies,
    median,
    timed_generate,
)
from ferrum.bench.throughput import measure_throughput
from ferrum.engine.arg_utils import EngineArgs
from ferrum.entrypoints.llm import LLM
from ferrum.sampling_params import SamplingParams

WORKLOADS = ("lat", "c16", "c64", "nano", "prefix", "long", "decode8k")
# The BENCHMARKS.md runs; the others run when named.
DEFAULT_WORKLOADS = WORKLOADS[:4]
LONG_PROMPTS, LONG_INPUT_LEN, LONG_OUTPUT_LEN = 32, 4000, 128
DECODE_CTX_PROMPTS, DECODE_CTX_LEN, DECODE_CTX_STEPS = 32, 8000, 128
# `prefix`: a shared prefix of this many tokens, then a suffix of PREFIX_SUFFIX_LEN.
PREFIX_LEN = 2000
PREFIX_SUFFIX_LEN = 16
PREFIX_SEED_BASE = 9000
# Timed `lat` prompts use seeds 1, 2, ...: lat_prompt(0) is the prefix of the c16/c64 prompt 0.
LAT_SEED_BASE = 1
# The throughput warm-up batch: its own seed, so it shares no prefix with a timed prompt.
WARMUP_SEED = 424242
# Prompts of `--repeats` repeat r > 0 of throughput workload i: recipe seed REPEAT_SEED_BASE +
# 1000 * i + r, far from every other seed here, so that no repeat shares a prompt prefix with
# another workload's or repeat's prompts (repeat 0 keeps the BENCHMARKS.md seeds below).
REPEAT_SEED_BASE = 500_000
THROUGHPUT_SEEDS = {"c16": 0, "c64": 0, "nano": 0, "long": 7}
WARMUP_OUTPUT_LEN = 8
C_TEMPERATURE = 1.0
NANO_TEMPERATURE = 0.6


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
        help="multiply every token and prompt count (tiny CPU runs: 0.02; nano lengths stay >= 100)",
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
    _synchronize(llm)
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
            report["throughput_warmup_s"] = _throughput_warmup(llm, vocab_size, args.scale)
            warmed_up = True
        start = time.perf_counter()
        if name == "lat":
            figures = run_lat(llm, vocab_size, args.scale, args.lat_warmup, args.lat_iters)
        elif name == "prefix":
            figures = run_prefix(llm, vocab_size, args.scale, args.lat_warmup, args.lat_iters)
        elif name == "decode8k":
            figures = run_decode_at_context(llm, vocab_size, args.scale)
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


def run_lat(
    llm: LLM, vocab_size: int, scale: float, num_warmup: int, num_iters: int
) -> dict[str, Any]:
    """TTFT = median time of a max_tokens=1 request; TPOT = (t(513) - t(1)) / 512 (medians)."""
    input_len = _scaled(128, scale)
    decode_len = _scaled(512, scale)
    greedy = {"temperature": 0.0, "ignore_eos": True}

    def prompts_for(seed: int) -> list[list[int]]:
        prompt = workloads.lat_prompt(seed=LAT_SEED_BASE + seed, n_in=input_len)
        return workloads.fold_to_vocab([prompt], vocab_size)

    first_times = measure_latencies(
        llm,
        lambda seed: prompts_for(TTFT_SEED_OFFSET + seed),
        SamplingParams(max_tokens=1, **greedy),
        num_warmup,
        num_iters,
    )
    full_times = measure_latencies(
        llm, prompts_for, SamplingParams(max_tokens=decode_len + 1, **greedy), num_warmup, num_iters
    )
    ttft = median(first_times)
    tpot = (median(full_times) - ttft) / decode_len
    return {
        "input_len": input_len,
        "output_len": decode_len + 1,
        "num_warmup": num_warmup,
        "num_iters": num_iters,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "ttft_ms": ttft * 1e3,
        "tpot_ms": tpot * 1e3,
        "t_first_s": first_times,
        "t_full_s": full_times,
    }


def run_prefix(
    llm: LLM, vocab_size: int, scale: float, num_warmup: int, num_iters: int
) -> dict[str, Any]:
    """Prefix-cache TTFT: per iteration a fresh PREFIX_LEN-token prefix, first with one suffix
    (cold: nothing cached) then with another (hit: the prefix comes from the cache), one
    max_tokens=1 request each; medians of each, and the tokens the hits served."""
    prefix_len, suffix_len = _scaled(PREFIX_LEN, scale), max(1, _scaled(PREFIX_SUFFIX_LEN, scale))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def pair(seed: int) -> tuple[list[int], list[int]]:
        tokens = workloads.lat_prompt(
            seed=PREFIX_SEED_BASE + seed, n_in=prefix_len + 2 * suffix_len
        )
        prefix, a, b = tokens[:prefix_len], tokens[prefix_len:-suffix_len], tokens[-suffix_len:]
        cold, hit = workloads.fold_to_vocab([prefix + a, prefix + b], vocab_size)
        return cold, hit

    for i in range(num_warmup):
        for prompt in pair(10_000 + i):
            timed_generate(llm, [prompt], params)
    cold_times, hit_times, cached = [], [], []
    for i in range(num_iters):
        cold, hit = pair(i)
        cold_times.append(timed_generate(llm, [cold], params)[0])
        seconds, outputs = timed_generate(llm, [hit], params)
        hit_times.append(seconds)
        cached.append(outputs[0].num_cached_tokens)
    cold_ttft, hit_ttft = median(cold_times), median(hit_times)
    return {
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "num_iters": num_iters,
        "cold_ttft_ms": cold_ttft * 1e3,
        "hit_ttft_ms": hit_ttft * 1e3,
        "speedup": cold_ttft / hit_ttft,
        "num_cached_tokens": cached,
        "t_cold_s": cold_times,
        "t_hit_s": hit_times,
    }


def run_throughput(
    llm: LLM, name: str, vocab_size: int, scale: float, engine_seed: int, repeat: int
) -> dict[str, Any]:
    """One run of the throughput workload `name` (c16, c64, nano or long), prompts of repeat
    `repeat` (0: the BENCHMARKS.md prompts; see REPEAT_SEED_BASE)."""
    seed = THROUGHPUT_SEEDS[name]
    if repeat:
        seed = REPEAT_SEED_BASE + 1000 * list(THROUGHPUT_SEEDS).index(name) + repeat
    if name == "nano":
        return run_nano(llm, vocab_size, scale, engine_seed, seed)
    if name == "long":
        return run_long(llm, vocab_size, scale, seed)
    return run_concurrent(llm, vocab_size, scale, _scaled(int(name[1:]), scale), seed)


def run_repeated(run: Callable[[int], dict[str, Any]], repeats: int) -> dict[str, Any]:
    """Repeat 0's figures; with repeats > 1 also every repeat's output tok/s and their median."""
    figures = run(0)
    if repeats > 1:
        rates = [figures["output_tokens_per_second"]]
        rates += [run(r)["output_tokens_per_second"] for r in range(1, repeats)]
        figures["repeats_output_tokens_per_second"] = rates
        figures["median_output_tokens_per_second"] = median(rates)
    return figures


def run_concurrent(
    llm: LLM, vocab_size: int, scale: float, num_prompts: int, seed: int
) -> dict[str, Any]:
    """`c16` / `c64`: every prompt submitted at once; output tokens / s."""
    input_len, output_len = _scaled(256, scale), _scaled(256, scale)
    prompts, output_lens = workloads.batch(num_prompts, input_len, output_len, seed=seed)
    result = measure_throughput(
        llm, workloads.fold_to_vocab(prompts, vocab_size), output_lens, C_TEMPERATURE
    )
    return {
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "temperature": C_TEMPERATURE,
        **result.to_dict(),
    }


def run_long(llm: LLM, vocab_size: int, scale: float, seed: int) -> dict[str, Any]:
    """`long`: 32 prompts of 4,000 tokens, 128 output tokens each, submitted at once."""
    num_prompts = _scaled(LONG_PROMPTS, scale)
    input_len, output_len = _scaled(LONG_INPUT_LEN, scale), _scaled(LONG_OUTPUT_LEN, scale)
    prompts, output_lens = workloads.batch(num_prompts, input_len, output_len, seed=seed)
    result = measure_throughput(
        llm, workloads.fold_to_vocab(prompts, vocab_size), output_lens, C_TEMPERATURE
    )
    return {"num_prompts": num_prompts, "input_len": input_len, **result.to_dict()}


def run_decode_at_context(llm: LLM, vocab_size: int, scale: float) -> dict[str, Any]:
    """`decode8k`: 32 prompts of 8,000 tokens brought to steady decode (every prompt prefilled),
    then 128 timed steps that each decode all 32: decode tok/s = 32 * 128 / their time."""
    num_prompts, input_len = _scaled(DECODE_CTX_PROMPTS, scale), _scaled(DECODE_CTX_LEN, scale)
    steps = _scaled(DECODE_CTX_STEPS, scale)
    prompts, _ = workloads.batch(num_prompts, input_len, 1, seed=11)
    engine = llm.llm_engine
    # Room for the settle steps and the tokens in flight: no request ends inside the timing.
    req_ids = start_decoding(
        engine, workloads.fold_to_vocab(prompts, vocab_size), steps + 16, temperature=0.0
    )
    _synchronize(llm)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _synchronize(llm)
    seconds = time.perf_counter() - start
    engine.abort_request(req_ids)
    return {
        "num_prompts": num_prompts,
        "context_len": input_len,
        "decode_steps": steps,
        "decode_tokens_per_second": num_prompts * steps / seconds,
        "decode_step_ms": seconds / steps * 1e3,
    }


def run_nano(
    llm: LLM, vocab_size: int, scale: float, engine_seed: int, seed: int
) -> dict[str, Any]:
    """`nano`: the seeded recipe at temperature 0.6 (sampling from the engine's seed); a seed
    other than 0 draws other prompts and lengths (`--repeats`)."""
    num_seqs = _scaled(256, scale)
    max_in, max_out = max(100, _scaled(1024, scale)), max(100, _scaled(1024, scale))
    prompts, output_lens = workloads.nano(
        seed=seed, num_seqs=num_seqs, max_in=max_in, max_out=max_out
    )
    result = measure_throughput(
        llm, workloads.fold_to_vocab(prompts, vocab_size), output_lens, NANO_TEMPERATURE
    )
    return {
        "num_prompts": num_seqs,
        "max_input_len": max_in,
        "max_output_len": max_out,
        "temperature": NANO_TEMPERATURE,
        "engine_seed": engine_seed,
        **result.to_dict(),
    }


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


def _throughput_warmup(llm: LLM, vocab_size: int, scale: float) -> float:
    """One short batch like c64: compiles the prefill and batched-decode paths untimed."""
    prompts, _ = workloads.batch(
        _scaled(64, scale), _scaled(256, scale), WARMUP_OUTPUT_LEN, seed=WARMUP_SEED
    )
    params = SamplingParams(
        temperature=C_TEMPERATURE, ignore_eos=True, max_tokens=WARMUP_OUTPUT_LEN
    )
    return timed_generate(llm, workloads.fold_to_vocab(prompts, vocab_size), params)[0]


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


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def _synchronize(llm: LLM) -> None:
    if llm.llm_engine.config.device_config.device.startswith("cuda"):
        torch.cuda.synchronize()


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
