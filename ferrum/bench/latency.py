"""`ferrum bench latency`: time one `LLM.generate` call on a batch of fixed shape (vLLM's flags).

Every iteration gets fresh random prompts (a new seed), so prefix caching never serves a timed
prompt. At batch size 1 it also reports TTFT (a request with max_tokens=1) and
TPOT = (t(output_len) - t(1)) / (output_len - 1), medians over the timed iterations."""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from ferrum.outputs import RequestOutput
from ferrum.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferrum.entrypoints.llm import LLM

PERCENTILES = (10, 25, 50, 75, 90, 99)
# Prompt seeds of the warm-up iterations start here, far from the timed ones (0, 1, 2, ...).
WARMUP_SEED_BASE = 1_000_000
# Prompt seeds of the TTFT (max_tokens=1) runs are offset by this, so they never share a prompt
# with the full-length runs.
TTFT_SEED_OFFSET = 2_000_000

TokenPrompts = list[list[int]]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (model positional) plus the latency flags; prompts are token ids."""
    from ferrum.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    parser.set_defaults(skip_tokenizer_init=True)
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per generate call")
    parser.add_argument("--n", type=int, default=1, help="completions per request")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--num-iters-warmup", type=int, default=3, help="untimed iterations")
    parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--output-json", default=None, help="write the figures to this file")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from ferrum.default_model import DEFAULT_MODEL_DIR
    from ferrum.engine.arg_utils import EngineArgs
    from ferrum.entrypoints.llm import LLM

    _check_args(args)
    engine_args = EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR)
    llm = LLM(**vars(engine_args))
    vocab_size = llm.llm_engine.config.model_config.vocab_size
    params = SamplingParams(
        n=args.n, temperature=args.temperature, ignore_eos=True, max_tokens=args.output_len
    )

    def prompts_for(seed: int) -> TokenPrompts:
        return random_prompts(args.batch_size, args.input_len, vocab_size, args.seed + seed)

    show_progress = not args.disable_tqdm
    latencies = measure_latencies(
        llm, prompts_for, params, args.num_iters_warmup, args.num_iters, show_progress
    )
    result: dict[str, Any] = {
        "avg_latency": sum(latencies) / len(latencies),
        "latencies": latencies,
        "percentiles": {str(p): percentile(latencies, p) for p in PERCENTILES},
    }
    print(f"Avg latency: {result['avg_latency']:.6f} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value:.6f} seconds")
    if args.batch_size == 1 and args.n == 1 and args.output_len > 1:
        first = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=1)
        ttft_times = measure_latencies(
            llm,
            lambda seed: prompts_for(TTFT_SEED_OFFSET + seed),
            first,
            args.num_iters_warmup,
            args.num_iters,
            show_progress,
        )
        ttft = median(ttft_times)
        result["ttft_s"] = ttft
        result["ttft_latencies"] = ttft_times
        result["tpot_s"] = (median(latencies) - ttft) / (args.output_len - 1)
        print(f"TTFT (median): {ttft * 1e3:.3f} ms")
        print(f"TPOT (median): {result['tpot_s'] * 1e3:.3f} ms")
    if args.output_json:
        result["engine_args"] = vars(engine_args)
        result["bench_args"] = {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "batch_size": args.batch_size,
            "n": args.n,
            "temperature": args.temperature,
            "num_iters_warmup": args.num_iters_warmup,
            "num_iters": args.num_iters,
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


def timed_generate(
    llm: LLM,
    prompts: TokenPrompts,
    params: SamplingParams | list[SamplingParams],
    use_tqdm: bool = False,
) -> tuple[float, list[RequestOutput]]:
    """Seconds of one `generate` call over token-id prompts, the device synchronized around it
    (`use_tqdm`: with generate's progress bar)."""
    synchronize = _device_synchronizer(llm)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    synchronize()
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=use_tqdm)
    synchronize()
    return time.perf_counter() - start, outputs


def measure_latencies(
    llm: LLM,
    prompts_for: Callable[[int], TokenPrompts],
    params: SamplingParams,
    num_warmup: int,
    num_iters: int,
    show_progress: bool = True,
) -> list[float]:
    """Times `num_iters` generate calls after `num_warmup` untimed ones; iteration i (warm-up:
    WARMUP_SEED_BASE + i) runs on `prompts_for(i)`. Progress bars count the iterations."""
    for i in tqdm(range(num_warmup), desc="Warm-up iterations", disable=not show_progress):
        timed_generate(llm, prompts_for(WARMUP_SEED_BASE + i), params)
    return [
        timed_generate(llm, prompts_for(i), params)[0]
        for i in tqdm(range(num_iters), desc="Timed iterations", disable=not show_progress)
    ]


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> TokenPrompts:
    """`num_prompts` prompts of `input_len` uniform token ids below min(vocab_size, 10001)."""
    from ferrum.bench.workloads import MAX_RECIPE_TOKEN_ID

    rng = random.Random(seed)
    high = min(vocab_size - 1, MAX_RECIPE_TOKEN_ID)
    return [[rng.randint(0, high) for _ in range(input_len)] for _ in range(num_prompts)]


def median(values: list[float]) -> float:
    return percentile(values, 50)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), `q` in [0, 100]."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _check_args(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup must be >= 0, got {args.num_iters_warmup}")


def _device_synchronizer(llm: LLM) -> Callable[[], None]:
    if llm.llm_engine.config.device_config.device.startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return lambda: None
