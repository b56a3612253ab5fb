"""The first batch of each size after a fresh start against the same-sized batch run again
(no kernel compilation in the serving path: the first within 5% of the repeat).

Dummy weights, token-id prompts, `ignore_eos`, one engine in this process and no warm-up of its
own: whatever start-up compiles is what a first user gets. Each case runs twice with different
prompts (seeds 1 and 2), so the repeat takes no prefix-cache hit. Cases: `c1` (1 x 128 in,
128 out), `c16` and `c64` (256 in, 256 out, temperature 1.0), `long` (one --long-len prompt, 1
token out: a long prefill), `mixed` (64 prompts of 100-2,048 tokens, 100-128 out, temperature
1.0: steps of many token counts, prefill chunks beside decodes; its two runs draw different
lengths, so its ratio is rough and its point is the compile list). One JSON with both times and
their ratio per case, and the Triton kernel variants each run compiled (start-up should have
compiled them all; `ferrum/model_executor/compile_watch.py`).

    python benchmarks/bench_first_request.py --model benchmarks/models/qwen3-30b-a3b \
        --gpu-memory-utilization 0.92 --max-model-len 10240 --out $OUT/first_request.json
"""

# ruff: noqa: E402
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrum.bench import workloads
from ferrum.bench.throughput import measure_throughput
from ferrum.engine.arg_utils import EngineArgs
from ferrum.entrypoints.llm import LLM
from ferrum.model_executor.compile_watch import compiled_while_serving


def cases(long_len: int) -> dict[str, tuple[int, int, int, float]]:
    """name: (prompts, input tokens, output tokens, temperature); `mixed` draws its lengths."""
    return {
        "c1": (1, 128, 128, 0.0),
        "c16": (16, 256, 256, 1.0),
        "c64": (64, 256, 256, 1.0),
        "long": (1, long_len, 1, 0.0),
        "mixed": (64, 2048, 128, 1.0),
    }


def case_workload(
    name: str, num: int, n_in: int, n_out: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    if name == "mixed":
        return workloads.nano(seed=seed, num_seqs=num, max_in=n_in, max_out=n_out)
    return workloads.batch(num, n_in, n_out, seed=seed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser, model_positional=False)
    parser.set_defaults(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
    parser.add_argument("--long-len", type=int, default=8000)
    parser.add_argument("--cases", default="c1,c16,c64,long,mixed", help="comma-separated subset")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.model is None:
        parser.error("--model is required")
    engine_args = EngineArgs.from_cli_args(args, args.model)
    in_process = (
        engine_args.tensor_parallel_size == 1
        and engine_args.pipeline_parallel_size == 1
        and engine_args.data_parallel_size == 1
        and engine_args.distributed_executor_backend in (None, "uni")
    )
    if not in_process:
        parser.error(
            "the compile lists are read in this process: run with one GPU and the uni executor"
        )
    start = time.perf_counter()
    llm = LLM(**vars(engine_args))
    report = {"model": args.model, "engine_init_s": time.perf_counter() - start, "cases": {}}
    vocab = llm.llm_engine.config.model_config.vocab_size
    chosen = args.cases.split(",")
    for name, (num, n_in, n_out, temperature) in cases(args.long_len).items():
        if name not in chosen:
            continue
        times = []
        compiled: list[list[str]] = []
        for seed in (1, 2):
            prompts, outs = case_workload(name, num, n_in, n_out, seed)
            prompts = workloads.fold_to_vocab(prompts, vocab)
            before = len(compiled_while_serving())
            result = measure_throughput(llm, prompts, outs, temperature, show_progress=False)
            times.append(result.elapsed_time)
            compiled.append([v.description for v in compiled_while_serving()[before:]])
        report["cases"][name] = {
            "first_s": times[0],
            "repeat_s": times[1],
            "first_over_repeat": times[0] / times[1],
            "compiled_first": compiled[0],
            "compiled_repeat": compiled[1],
        }
        print(
            f"{name}: first {times[0]:.3f} s, repeat {times[1]:.3f} s, "
            f"ratio {times[0] / times[1]:.3f}, Triton variants compiled "
            f"{len(compiled[0])} / {len(compiled[1])}",
            flush=True,
        )
        for description in compiled[0] + compiled[1]:
            print(f"  compiled: {description}", flush=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
