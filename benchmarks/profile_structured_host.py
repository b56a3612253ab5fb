"""Host cost of a constrained decode step on the CPU: where the time goes that the GPU forward
must hide at large batches.

A one-layer Qwen3 with Qwen3's vocabulary (151,936 rows, hidden 64, dummy fp32 weights) on the
CPU, the synthetic Qwen-size tokenizer of bench_grammar_compile.py, async scheduling on and every
request under bench_structured_output.py's JSON schema. `--steps` decode steps at `--batch`
running requests are timed by phase (time.perf_counter spans around the engine's functions):

- device: the forward, the logits and the sampler. On a GPU they run on the device; here they run
  inline, so they are timed apart and left out of the host total;
- host: everything else a step does: schedule, inputs, completing the previous step (scheduler
  update, with the matchers accepting tokens), the bitmask (xgrammar fill, min_tokens masking,
  the copy), sampling metadata, output processing (detokenize).

The host total is what must fit under the forward (7.3 ms for 8B shapes at batch 64 on the
H100) for the constrained overhead to vanish. `--cprofile N` prints cProfile's top N functions
for the same steps. Usage: python benchmarks/profile_structured_host.py --batch 64 --steps 64
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_grammar_compile import QWEN_MODEL_VOCAB
from bench_structured_output import LONG_SCHEMA, model_folder

from ferrum.bench import workloads
from ferrum.entrypoints.llm import LLM
from ferrum.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "vocab_size": QWEN_MODEL_VOCAB,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

DEVICE_PHASES = ("forward", "logits", "sampler")


def wrap(phases: dict[str, float], name: str, fn: Callable) -> Callable:
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] += time.perf_counter() - start

    return timed


class _TimedFiller:
    """Stands in for the runner's slotted bitmask filler with a timed `fill`."""

    def __init__(self, filler: object, fill: Callable) -> None:
        self.filler = filler
        self.fill = fill


_IDLE = "device idle: deferred sample -> next forward"
_state = {"in_launch": False, "sample_end": None}


def _note_launch(runner, launch: Callable) -> Callable:
    def noted(*args, **kwargs):
        _state["in_launch"] = True
        try:
            return launch(*args, **kwargs)
        finally:
            _state["in_launch"] = False

    return noted


def _note_deferred_sample_end(phases: dict[str, float], runner, sample: Callable) -> Callable:
    """A sampling queued by the core (not inside launch) is a deferred one: the device has
    nothing else queued until the next forward is."""

    def noted(*args, **kwargs):
        try:
            return sample(*args, **kwargs)
        finally:
            if not _state["in_launch"]:
                _state["sample_end"] = time.perf_counter()

    return noted


def _note_forward_start(phases: dict[str, float], forward: Callable) -> Callable:
    def noted(*args, **kwargs):
        if _state["sample_end"] is not None:
            phases[_IDLE] += time.perf_counter() - _state["sample_end"]
            _state["sample_end"] = None
        return forward(*args, **kwargs)

    return noted


def instrument(llm: LLM, phases: dict[str, float]) -> None:
    """Wraps the engine's step phases in spans (nested spans are reported by their own name,
    and counted inside their parent's)."""
    engine = llm.llm_engine
    core = engine.core
    runner = core.executor.runner
    buffers = runner.grammar_bitmasks
    scheduler = core.scheduler
    scheduler.schedule = wrap(phases, "schedule", scheduler.schedule)
    scheduler.update_from_output = wrap(
        phases, "complete: scheduler update", scheduler.update_from_output
    )
    scheduler._accept_by_grammar = wrap(
        phases, "  of which matcher accept", scheduler._accept_by_grammar
    )
    runner.complete = wrap(phases, "complete: runner (tokens to host)", runner.complete)
    runner.inputs.prepare = wrap(phases, "inputs", runner.inputs.prepare)
    runner._forward = wrap(phases, "forward", _note_forward_start(phases, runner._forward))
    runner.sample = _note_deferred_sample_end(phases, runner, runner.sample)
    runner.launch = _note_launch(runner, runner.launch)
    runner.model.compute_logits = wrap(phases, "logits", runner.model.compute_logits)
    runner.sampler = wrap(phases, "sampler", runner.sampler)
    buffers.fill = wrap(phases, "bitmask (all)", buffers.fill)
    buffers._filler = _TimedFiller(
        buffers._filler, wrap(phases, "  of which xgrammar fill", buffers._filler.fill)
    )
    engine.output_processor.process = wrap(
        phases, "output processing", engine.output_processor.process
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (the CPU sampler is slow at 1)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--unconstrained", action="store_true", help="no schema (a baseline)")
    parser.add_argument("--cprofile", type=int, default=0, help="print the top N functions")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as work:
        config_dir = Path(work) / "config"
        config_dir.mkdir()
        (config_dir / "config.json").write_text(json.dumps(TINY_QWEN3))
        folder = model_folder(config_dir, Path(work))
        llm = LLM(
            str(folder),
            load_format="dummy",
            dtype="float32",
            device="cpu",
            async_scheduling=True,
            num_cpu_threads=args.threads,
            max_num_seqs=args.batch,
            max_model_len=args.input_len + args.steps + 64,
            structured_outputs_config={"disable_any_whitespace": True},
        )
        engine = llm.llm_engine
        core = engine.core
        structured = None if args.unconstrained else StructuredOutputsParams(json=LONG_SCHEMA)
        params = SamplingParams(
            temperature=args.temperature,
            max_tokens=args.steps + 48,
            ignore_eos=True,
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,
        )
        prompts, _ = workloads.batch(args.batch, args.input_len, 1, seed=7)
        for i, prompt in enumerate(workloads.fold_to_vocab(prompts, QWEN_MODEL_VOCAB)):
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        while core.scheduler.num_waiting or any(
            r.num_output_tokens == 0 for r in core.scheduler.running
        ):
            engine.step()
        for _ in range(8):
            engine.step()
        phases: dict[str, float] = defaultdict(float)
        instrument(llm, phases)
        profiler = cProfile.Profile() if args.cprofile else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        for _ in range(args.steps):
            engine.step()
        if profiler is not None:
            profiler.disable()
        wall = time.perf_counter() - start
        running = core.scheduler.num_running
        engine.abort_request([str(i) for i in range(args.batch)])
    per_step = {name: total / args.steps * 1e3 for name, total in phases.items()}
    device_ms = sum(per_step.get(name, 0.0) for name in DEVICE_PHASES)
    step_ms = wall / args.steps * 1e3
    host_ms = step_ms - device_ms
    print(
        f"batch {args.batch}, {'unconstrained' if args.unconstrained else 'json schema'}, "
        f"{running} running at the end: step {step_ms:.3f} ms = host {host_ms:.3f} ms + "
        f"device stand-in {device_ms:.3f} ms"
    )
    for name, ms in sorted(per_step.items(), key=lambda kv: -kv[1]):
        kind = "device" if name in DEVICE_PHASES else "gap" if name == _IDLE else "host"
        print(f"  {name:36s} {ms:8.3f} ms  {kind}")
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    if args.out:
        result = {
            "batch": args.batch,
            "constrained": not args.unconstrained,
            "steps": args.steps,
            "running_at_end": running,
            "step_ms": step_ms,
            "host_ms": host_ms,
            "device_stand_in_ms": device_ms,
            "phases_ms": per_step,
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
