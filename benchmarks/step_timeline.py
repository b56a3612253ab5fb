"""Wall time of every engine step of one batch, from submission to the last token.

Runs `--num-prompts` prompts of `--input-len` tokens with `--output-len` output tokens each (the
`c16`/`c64` shape) on dummy weights and prints, per kind of step (with prompt tokens / decode
only), the number of steps, their total and median wall time, and the slowest steps with their
token counts: where a workload's time goes between the steady decode steps that
`profile_steps.py` measures.
Usage: python benchmarks/step_timeline.py --model benchmarks/models/qwen3-30b-a3b --num-prompts 64
"""

# ruff: noqa: E402
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.dummy_engine import engine_parser, make_llm
from ferrum.bench import workloads
from ferrum.sampling_params import SamplingParams


def main() -> int:
    parser = engine_parser(__doc__.splitlines()[0])
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument(
        "--cached-prompts",
        type=int,
        default=0,
        help="the warm-up runs the first N timed prompts, so they hit the prefix cache",
    )
    parser.add_argument(
        "--per-request-params",
        action="store_true",
        help="one SamplingParams object per prompt, as the throughput workloads pass them",
    )
    args = parser.parse_args()
    llm = make_llm(args)
    core = llm.llm_engine.core
    vocab = llm.llm_engine.config.model_config.vocab_size
    params = SamplingParams(
        temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True
    )

    def synchronize() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def run(seed: int, num_prompts: int = args.num_prompts) -> float:
        prompts, _ = workloads.batch(num_prompts, args.input_len, 1, seed=seed)
        inputs = [{"prompt_token_ids": p} for p in workloads.fold_to_vocab(prompts, vocab)]
        request_params = [params.clone() for _ in inputs] if args.per_request_params else params
        synchronize()
        start = time.perf_counter()
        llm.generate(inputs, request_params, use_tqdm=False)
        synchronize()
        return time.perf_counter() - start

    run(seed=101)  # warm-up, untimed
    if args.cached_prompts:
        run(seed=0, num_prompts=args.cached_prompts)
    steps: list[tuple[float, int, int]] = []  # (seconds, scheduled tokens, scheduled requests)
    schedule, step = core.scheduler.schedule, core.step
    scheduled: list[tuple[int, int]] = []

    def timed_schedule():
        output = schedule()
        scheduled.append((output.total_num_scheduled_tokens, len(output.num_scheduled_tokens)))
        return output

    def timed_step():
        start = time.perf_counter()
        try:
            return step()
        finally:
            steps.append((time.perf_counter() - start, *scheduled[-1]))

    core.scheduler.schedule, core.step = timed_schedule, timed_step
    total = run(seed=0)
    core.scheduler.schedule, core.step = schedule, step
    output_tokens = args.num_prompts * args.output_len
    print(f"{total:.3f} s, {output_tokens / total:.0f} output tok/s, {len(steps)} steps")
    kinds = {
        "with prompt tokens": [s for s in steps if s[1] > s[2]],
        "decode only": [s for s in steps if s[1] == s[2]],
    }
    for name, group in kinds.items():
        if group:
            times = [s[0] * 1e3 for s in group]
            print(
                f"  {name:20s} {len(group):5d} steps {sum(times):9.1f} ms total, median "
                f"{statistics.median(times):7.2f} ms"
            )
    print("  slowest steps (ms, scheduled tokens, requests):")
    for seconds, tokens, reqs in sorted(steps, reverse=True)[:8]:
        print(f"    {seconds * 1e3:8.2f} {tokens:6d} {reqs:4d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
