"""Structured-output overhead in the engine: decode TPOT with a JSON-schema constraint vs without,
and grammar compile times through the engine's own manager.

Model: `--model` (default benchmarks/models/qwen3-8b: Qwen3-8B shapes) with dummy weights, bf16.
The engine needs a tokenizer for grammars: a synthetic byte-level vocabulary of Qwen3's size
(151,643 regular + 3 special tokens, padded to the model's 151,936 rows; see
bench_grammar_compile.py) is written beside a copy of the config, so the mask covers the real
vocabulary width without any download.

For each batch size (`--batch`, default 1,64): `batch` requests with `--input-len` token prompts
are prefilled, then `--steps` decode steps are timed (wall time per engine step = TPOT), once
unconstrained and once with every request under the schema below (it cannot end before
`--steps` tokens: a minimum item count; `constrained_running_at_end` checks it). The host time
spent filling bitmasks is reported too.
Async scheduling (the CUDA default) is on for both runs: a constrained step's forward is queued
first, and its mask is filled (after the previous step's tokens reach the matchers) while the
device runs it; `deferred_sampling_steps` counts the steps sampled that way.
Compile: p50/p99 of `--compile-iters` cold compiles (a tool-call schema, each with a fresh title)
and of warm ones (the same schema again: a cache hit).

Usage (GPU): python benchmarks/bench_structured_output.py --batch 1,64 --steps 64
       --out $OUT/structured_output.json
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_grammar_compile import QWEN_MODEL_VOCAB, TOOL_CALL, qwen_size_tokenizer

from ferrum.bench import workloads
from ferrum.entrypoints.llm import LLM
from ferrum.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# JSON that cannot end within the timed steps (at least 200 strings, 2+ tokens each) and whose
# masks cost what JSON strings cost (p50 ~85 us per row on the synthetic vocabulary, one core).
LONG_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
    "required": ["items"],
    "additionalProperties": False,
}


def model_folder(config_dir: Path, work: Path) -> Path:
    """A copy of the model config with the synthetic Qwen-size tokenizer beside it."""
    folder = work / "model"
    folder.mkdir()
    shutil.copy(config_dir / "config.json", folder / "config.json")
    config = json.loads((folder / "config.json").read_text())
    if config["vocab_size"] != QWEN_MODEL_VOCAB:
        raise SystemExit(f"--model must have vocab_size {QWEN_MODEL_VOCAB} for this tokenizer")
    tokenizer = qwen_size_tokenizer()
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "additional_special_tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            }
        )
    )
    return folder


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_decode(llm: LLM, batch: int, input_len: int, steps: int, schema: dict | None) -> dict:
    """Mean wall time of one decode step at `batch` running requests, and the bitmask fill time."""
    engine = llm.llm_engine
    core = engine.core
    vocab = engine.config.model_config.vocab_size
    prompts, _ = workloads.batch(batch, input_len, 1, seed=7)
    structured = None if schema is None else StructuredOutputsParams(json=schema)
    params = SamplingParams(
        temperature=1.0,
        max_tokens=steps + 64,
        ignore_eos=True,
        structured_outputs=structured,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    ids = [f"{batch}-{schema is not None}-{i}" for i in range(batch)]
    for req_id, prompt in zip(ids, workloads.fold_to_vocab(prompts, vocab)):
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    while core.scheduler.num_waiting or any(
        r.num_output_tokens == 0 for r in core.scheduler.running
    ):
        engine.step()
    for _ in range(8):  # past the first masks of new grammar states
        engine.step()
    runner = core.executor.runner
    fill_seconds = [0.0]
    real_fill: Callable = runner.grammar_bitmasks.fill

    def timed_fill(*args):
        start = time.perf_counter()
        try:
            return real_fill(*args)
        finally:
            fill_seconds[0] += time.perf_counter() - start

    runner.grammar_bitmasks.fill = timed_fill
    real_sample: Callable = runner.sample
    num_deferred = [0]

    def counted_sample(step) -> None:  # called by the core only for deferred sampling
        num_deferred[0] += 1
        real_sample(step)

    runner.sample = counted_sample
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize()
    wall = (time.perf_counter() - start) / steps
    runner.grammar_bitmasks.fill = real_fill
    runner.sample = real_sample
    running = core.scheduler.num_running
    engine.abort_request(ids)
    return {
        "tpot_ms": wall * 1e3,
        "mask_fill_ms_per_step": fill_seconds[0] / steps * 1e3,
        "running_at_end": running,
        "deferred_sampling_steps": num_deferred[0],
    }


def time_compiles(llm: LLM, iters: int) -> dict:
    grammars = llm.llm_engine.core.grammars
    grammars.compile(StructuredOutputsParams(json={"type": "object"}))  # the service is built
    cold, warm = [], []
    for i in range(iters):
        schema = dict(TOOL_CALL, title=f"bench-{time.time_ns()}-{i}")
        start = time.perf_counter()
        grammars.compile(StructuredOutputsParams(json=schema))
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        grammars.compile(StructuredOutputsParams(json=schema))
        warm.append(time.perf_counter() - start)

    def percentiles(values: list[float]) -> tuple[float, float]:
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
        return statistics.median(ordered) * 1e3, p99 * 1e3

    (cold_p50, cold_p99), (warm_p50, warm_p99) = percentiles(cold), percentiles(warm)
    return {
        "schema": "tool_call",
        "cold_p50_ms": cold_p50,
        "cold_p99_ms": cold_p99,
        "warm_p50_ms": warm_p50,
        "warm_p99_ms": warm_p99,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(Path(__file__).parent / "models" / "qwen3-8b"))
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--compile-iters", type=int, default=20)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    with tempfile.TemporaryDirectory() as work:
        folder = model_folder(Path(args.model), Path(work))
        llm = LLM(
            str(folder),
            load_format="dummy",
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=max(batches),
            max_model_len=args.input_len + args.steps + 128,
            structured_outputs_config={"disable_any_whitespace": True},
        )
        rows = []
        for batch in batches:
            free = time_decode(llm, batch, args.input_len, args.steps, None)
            constrained = time_decode(llm, batch, args.input_len, args.steps, LONG_SCHEMA)
            overhead = constrained["tpot_ms"] / free["tpot_ms"] - 1.0
            rows.append(
                {
                    "batch": batch,
                    "tpot_ms_unconstrained": free["tpot_ms"],
                    "tpot_ms_json_schema": constrained["tpot_ms"],
                    "overhead_pct": overhead * 100,
                    "mask_fill_ms_per_step": constrained["mask_fill_ms_per_step"],
                    "constrained_running_at_end": constrained["running_at_end"],
                    "deferred_sampling_steps": constrained["deferred_sampling_steps"],
                }
            )
        compiles = time_compiles(llm, args.compile_iters)
    print(
        f"{'batch':>5} {'TPOT free ms':>13} {'TPOT json ms':>13} {'overhead':>9} {'fill ms':>8}"
        f" {'deferred':>8}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['tpot_ms_unconstrained']:>13.3f} {r['tpot_ms_json_schema']:>13.3f}"
            f" {r['overhead_pct']:>8.2f}% {r['mask_fill_ms_per_step']:>8.3f}"
            f" {r['deferred_sampling_steps']:>8}"
        )
    print(
        f"compile (tool_call schema): cold p50 {compiles['cold_p50_ms']:.1f} ms, p99 "
        f"{compiles['cold_p99_ms']:.1f} ms; warm p50 {compiles['warm_p50_ms']:.3f} ms, p99 "
        f"{compiles['warm_p99_ms']:.3f} ms"
    )
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "decode": rows,
        "compile": compiles,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
