"""Profiles steady-state engine steps: where the wall time of a step goes, host and device.

Admits a batch of dummy-weight requests, steps until every prompt is prefilled, then times and
profiles `--steps` decode steps: wall time per step, the engine's host phases, and the top CUDA
kernels. `--wall-only` times the steps and nothing else, so any executor runs (mp, ray: their
runners live in other processes). `--replay-drafts K`: every step is a verify step of K drafts
per request that are all rejected (the benchmark's replay proposer at acceptance 0), so the
step's cost beside a plain decode step's is the verify overhead. Usage: python
benchmarks/profile_steps.py --model benchmarks/models/qwen3-0.6b --num-prompts 64 --input-len 256
[--wall-only] [--replay-drafts 3] [engine flags]
"""

# ruff: noqa: E402
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.dummy_engine import engine_parser, make_llm, start_decoding
from ferrum.bench import workloads
from ferrum.model_folder import read_hf_config


def timed(phases: dict[str, float], name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start

    return wrapper


def main() -> int:
    parser = engine_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--wall-only", action="store_true", help="no phase timers, no profile")
    parser.add_argument("--replay-drafts", type=int, default=0, help="K rejected drafts a step")
    args = parser.parse_args()
    config = read_hf_config(args.model)
    config = config.get("text_config", config)
    vocab = config["vocab_size"]
    prompts, _ = workloads.batch(args.num_prompts, args.input_len, 1, seed=7)
    prompts = workloads.fold_to_vocab(prompts, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        if args.replay_drafts:
            # Drafts for every position the engine could reach (its default: the config's).
            max_len = args.max_model_len or config.get("max_position_embeddings", 1 << 15)
            drafts = Path(tmp) / "drafts.json"
            drafts.write_text(json.dumps({",".join(map(str, p)): [0] * max_len for p in prompts}))
            args.speculative_config = {
                "method": "replay", "num_speculative_tokens": args.replay_drafts,
                "model": str(drafts), "acceptance_rate": 0.0, "disable_by_batch_size": None,
            }  # fmt: skip
        return profile(args, prompts)


def profile(args, prompts: list[list[int]]) -> int:  # noqa: ANN001
    llm = make_llm(args)
    engine = llm.llm_engine
    max_tokens = engine.config.model_config.max_model_len - args.input_len - 8
    req_ids = start_decoding(engine, prompts, max_tokens, args.temperature)
    core = engine.core

    if args.wall_only:
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = (time.perf_counter() - start) / args.steps
        print(f"batch {args.num_prompts}: {wall * 1e3:.3f} ms per decode step (wall only)")
        engine.abort_request(req_ids)
        return 0
    phases: dict[str, float] = defaultdict(float)
    runner = core.executor.runner
    core.scheduler.schedule = timed(phases, "schedule", core.scheduler.schedule)
    core.scheduler.update_from_output = timed(phases, "update", core.scheduler.update_from_output)
    runner.inputs.prepare = timed(phases, "inputs (build + copy)", runner.inputs.prepare)
    runner._forward = timed(phases, "forward (launch or replay)", runner._forward)
    runner.sampler = timed(phases, "sampler", runner.sampler)
    engine.output_processor.process = timed(phases, "output", engine.output_processor.process)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    print(f"batch {args.num_prompts}: {wall * 1e3:.3f} ms per decode step")
    for name, total in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {total / args.steps * 1e3:8.3f} ms")

    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    )
    engine.abort_request(req_ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
