"""Speculative decoding's speed on one model (dummy weights, one JSON):

1. `lat` (BENCHMARKS.md: batch 1, 128-token prompt, TPOT over 512 tokens) and `c64` / `nano`
   without speculation;
2. `lat` with the replay proposer at each acceptance rate of `--alphas`: it proposes the
   target's own greedy continuation (recorded in step 1, then re-recorded through the verify
   step until it reproduces itself), each draft replaced by a wrong token with probability
   1 - alpha, so the acceptance rate is set (dummy weights cannot give a real one); the
   measured acceptance is reported beside it;
3. with `--draft-model`: `lat` with that draft model, and the draft's own time per proposed
   token (its greedy decode steps, timed on their own); with `--eagle3-head` (a head folder, or
   `auto`: a head of the target's shapes with a 32k draft vocabulary): `lat` with the head
   (dummy weights: acceptance ~0, so TPOT is the head's overhead) and its own times: its pass
   over each step's rows, and per proposed token (pass + decode steps);
4. `c64` / `nano` with speculation on (`--on-config`, n-gram by default): adaptive speculation
   must not make a loaded engine slower.

Usage: python benchmarks/bench_spec_decode.py --model benchmarks/models/qwen3-8b --out x.json
(engine flags as for run_workloads.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO_ROOT))

import torch  # noqa: E402

from benchmarks.workload_runs import (  # noqa: E402
    LAT_SEED_BASE,
    run_lat,
    run_repeated,
    run_throughput,
    synchronize,
    throughput_warmup,
)
from ferrum import SamplingParams  # noqa: E402
from ferrum.bench import workloads  # noqa: E402
from ferrum.bench.latency import WARMUP_SEED_BASE  # noqa: E402
from ferrum.engine.arg_utils import EngineArgs  # noqa: E402
from ferrum.entrypoints.llm import LLM  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
# Runs of each throughput workload (their median is reported).
REPEATS = 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser, model_positional=False)
    # No prefix caching: a replayed continuation must come from a prefill like the one it is
    # replayed for (a cached prefix changes the numerics, and with them near-tied tokens).
    parser.set_defaults(
        load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", enable_prefix_caching=False
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--alphas", default="0,0.7,1", help="replay acceptance rates")
    parser.add_argument("--draft-model", default=None, help="a draft model folder (dummy too)")
    parser.add_argument(
        "--eagle3-head", default=None, help="an EAGLE-3 head folder (dummy too), or auto"
    )
    parser.add_argument(
        "--record-rounds", type=int, default=3, help="re-recordings through the verify step"
    )
    parser.add_argument("--on-config", type=json.loads, default=NGRAM)
    parser.add_argument("--throughput", default="c64,nano", help="'' to skip step 4")
    parser.add_argument("--lat-iters", type=int, default=3)
    parser.add_argument("--lat-warmup", type=int, default=1)
    return parser.parse_args()


def lat_prompts(vocab_size: int, args: argparse.Namespace) -> list[list[int]]:
    """The prompts `run_lat` decodes 513 tokens from (warm-up and timed iterations)."""
    seeds = [WARMUP_SEED_BASE + i for i in range(args.lat_warmup)] + list(range(args.lat_iters))
    prompts = [workloads.lat_prompt(seed=LAT_SEED_BASE + s, n_in=128) for s in seeds]
    return workloads.fold_to_vocab(prompts, vocab_size)


def greedy_continuations(llm: LLM, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Each prompt's 513 greedy tokens, keyed as the replay proposer reads them; one prompt at
    a time, like lat (a batch's other numerics could change a near-tied token)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=513, ignore_eos=True)
    recorded = {}
    for p in prompts:
        (output,) = llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)
        recorded[",".join(map(str, p))] = output.outputs[0].token_ids
    return recorded


def record_through_verify(
    args: argparse.Namespace, path: Path, recorded: dict[str, list[int]]
) -> list[float]:
    """Re-records the continuations (in `path`) through the verify step: replayed at acceptance
    1, each round's greedy tokens become the next round's proposals, until a round accepts
    every draft (at most --record-rounds). Decode rows (GEMV, split-KV) and verify rows (GEMM,
    the unified kernel) round differently, and a dummy model's near-tied logits turn that into
    different tokens, so a continuation recorded without speculation is not what the verify
    step produces. Returns each round's acceptance of the previous recording: only a last 1.0
    means the recording the alpha runs replay reproduces itself."""
    spec = {"method": "replay", "num_speculative_tokens": args.num_speculative_tokens,
            "model": str(path), "acceptance_rate": 1.0}  # fmt: skip
    prompts = [[int(t) for t in key.split(",")] for key in recorded]
    rates: list[float] = []
    for _ in range(args.record_rounds):

        def rerecord(llm: LLM) -> tuple[dict[str, list[int]], float]:
            tokens = greedy_continuations(llm, prompts)
            return tokens, spec_stats(llm)["acceptance_rate"]

        recorded, rate = with_engine(args, rerecord, speculative_config=spec)
        path.write_text(json.dumps(recorded))
        rates.append(rate)
        if rate == 1.0:
            break
    return rates


def with_engine(args: argparse.Namespace, run: Callable[[LLM], Any], **overrides: Any) -> Any:
    """`run(llm)` on a fresh engine, which is then shut down and its GPU memory freed."""
    llm = LLM(**(vars(EngineArgs.from_cli_args(args, args.model)) | overrides))
    try:
        synchronize(llm)
        return run(llm)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def spec_stats(llm: LLM) -> dict[str, Any]:
    stats = llm.llm_engine.stats()
    drafted = max(stats.spec_num_draft_tokens, 1)
    return {
        "drafts": stats.spec_num_drafts,
        "draft_tokens": stats.spec_num_draft_tokens,
        "accepted_tokens": stats.spec_num_accepted_tokens,
        "acceptance_rate": stats.spec_num_accepted_tokens / drafted,
        "mean_tokens_per_verify": 1
        + stats.spec_num_accepted_tokens / max(stats.spec_num_drafts, 1),
    }


def throughput(llm: LLM, names: list[str], vocab_size: int, seed: int) -> dict[str, Any]:
    if not names:
        return {}
    throughput_warmup(llm, vocab_size, 1.0)
    return {
        name: run_repeated(
            lambda repeat, name=name: run_throughput(llm, name, vocab_size, 1.0, seed, repeat),
            REPEATS,
        )["median_output_tokens_per_second"]
        for name in names
    }


def draft_time_per_token(llm: LLM, prompt: list[int]) -> float:
    """Seconds the draft model takes per proposed token: its `propose` calls during one
    512-token greedy decode, timed with a device sync around each."""
    runner = llm.llm_engine.client.core.executor.runner  # in-process, one GPU
    decoder = runner.speculative
    assert decoder is not None and decoder.draft is not None
    original, spent, proposed = decoder.draft.propose, [0.0], [0]

    def timed(*a: Any, **kw: Any) -> dict[str, list[int]]:
        synchronize(llm)
        start = time.perf_counter()
        drafts = original(*a, **kw)
        spent[0] += time.perf_counter() - start
        proposed[0] += sum(len(d) for d in drafts.values())
        return drafts

    decoder.draft.propose = timed
    params = SamplingParams(temperature=0.0, max_tokens=513, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    decoder.draft.propose = original
    return spent[0] / max(proposed[0], 1)


def eagle3_times(llm: LLM, prompt: list[int]) -> dict[str, float]:
    """During one 512-token greedy decode, each call timed with a device sync around it: the
    head's pass over a step's rows, and per proposed token the pass and the decode steps of
    the steps that proposed (dummy weights: the adaptive proposer soon proposes only every ~20
    steps, but the pass runs every step)."""
    runner = llm.llm_engine.client.core.executor.runner  # in-process, one GPU
    head = runner.speculative.eagle3
    assert head is not None
    spent = {"after_sampling": 0.0, "propose": 0.0}
    calls, proposing, proposed = [0], [0], [0]
    originals = {name: getattr(head, name) for name in spent}

    def timed(name: str, *a: Any, **kw: Any) -> Any:
        synchronize(llm)
        start = time.perf_counter()
        result = originals[name](*a, **kw)
        synchronize(llm)
        if name == "after_sampling":
            calls[0] += 1
        elif result:
            proposing[0] += 1
            proposed[0] += sum(len(d) for d in result.values())
        else:
            return result
        spent[name] += time.perf_counter() - start
        return result

    for name in spent:
        setattr(head, name, partial(timed, name))
    params = SamplingParams(temperature=0.0, max_tokens=513, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    for name in spent:
        setattr(head, name, originals[name])
    pass_s = spent["after_sampling"] / max(calls[0], 1)
    return {
        "pass_s_per_step": pass_s,
        "s_per_proposed_token": (pass_s * proposing[0] + spent["propose"]) / max(proposed[0], 1),
        "proposed_tokens": proposed[0],
    }


def auto_eagle3_head(model: str) -> str:
    """A head folder (config.json only: dummy weights) of the target's shapes."""
    target = json.loads((Path(model) / "config.json").read_text())
    keys = (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "vocab_size",
        "max_position_embeddings",
    )
    config = {key: target[key] for key in keys if key in target}
    config |= {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
               "draft_vocab_size": min(32000, target["vocab_size"])}  # fmt: skip
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def main() -> None:
    args = parse_args()
    report: dict[str, Any] = {"model": args.model, "k": args.num_speculative_tokens}
    names = [n for n in args.throughput.split(",") if n]
    lat = partial(run_lat, scale=1.0, num_warmup=args.lat_warmup, num_iters=args.lat_iters)

    def off(llm: LLM) -> tuple[dict[str, Any], dict[str, list[int]]]:
        config = llm.llm_engine.config.model_config
        figures = {"lat": lat(llm, config.vocab_size)}
        figures |= throughput(llm, names, config.vocab_size, config.seed)
        recorded = greedy_continuations(llm, lat_prompts(config.vocab_size, args))
        return figures | {"vocab_size": config.vocab_size, "seed": config.seed}, recorded

    report["off"], recorded = with_engine(args, off)
    vocab_size, seed = report["off"]["vocab_size"], report["off"]["seed"]
    path = Path(tempfile.mkdtemp()) / "continuations.json"
    path.write_text(json.dumps(recorded))
    k = args.num_speculative_tokens
    report["recording_acceptance"] = record_through_verify(args, path, recorded)
    report["replay"] = {}
    for alpha in [float(a) for a in args.alphas.split(",")]:
        spec = {"method": "replay", "num_speculative_tokens": k, "model": str(path),
                "acceptance_rate": alpha}  # fmt: skip
        report["replay"][str(alpha)] = with_engine(
            args, lambda llm: {"lat": lat(llm, vocab_size), **spec_stats(llm)},
            speculative_config=spec,
        )  # fmt: skip
        _write(args.out, report)
    if args.draft_model:
        spec = {"method": "draft_model", "num_speculative_tokens": k, "model": args.draft_model}
        first_prompt = [int(t) for t in next(iter(recorded)).split(",")]

        def drafted(llm: LLM) -> dict[str, Any]:
            figures = {"lat": lat(llm, vocab_size)}
            figures["draft_s_per_token"] = draft_time_per_token(llm, first_prompt)
            return figures | spec_stats(llm)

        report["draft_model"] = with_engine(args, drafted, speculative_config=spec)
        _write(args.out, report)
    if args.eagle3_head:
        folder = auto_eagle3_head(args.model) if args.eagle3_head == "auto" else args.eagle3_head
        spec = {"method": "eagle3", "num_speculative_tokens": k, "model": folder}
        first_prompt = [int(t) for t in next(iter(recorded)).split(",")]

        def headed(llm: LLM) -> dict[str, Any]:
            figures = {"lat": lat(llm, vocab_size)} | eagle3_times(llm, first_prompt)
            return figures | spec_stats(llm)

        report["eagle3"] = with_engine(args, headed, speculative_config=spec)
        _write(args.out, report)
    if names:
        report["on"] = with_engine(
            args,
            lambda llm: (
                {"config": args.on_config, **throughput(llm, names, vocab_size, seed)}
                | spec_stats(llm)
            ),
            speculative_config=args.on_config,
        )
    _write(args.out, report)
    print(json.dumps(_summary(report), indent=1))


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    off_tpot = report["off"]["lat"]["tpot_ms"]
    rounds = report.get("recording_acceptance") or []
    summary: dict[str, Any] = {
        "off_tpot_ms": off_tpot,
        "recording_acceptance": rounds,
        # False: the replayed continuation was re-recorded once more than it was checked.
        "recording_converged": bool(rounds) and rounds[-1] == 1.0,
    }
    for alpha, run in report.get("replay", {}).items():
        tpot = run["lat"]["tpot_ms"]
        summary[f"alpha={alpha}"] = {"tpot_ms": tpot, "ratio": tpot / off_tpot,
                                     "acceptance": run["acceptance_rate"]}  # fmt: skip
    if "draft_model" in report:
        run = report["draft_model"]
        summary["draft_model"] = {"tpot_ms": run["lat"]["tpot_ms"],
                                  "draft_ms_per_token": 1e3 * run["draft_s_per_token"]}  # fmt: skip
    if "eagle3" in report:
        run = report["eagle3"]
        summary["eagle3"] = {
            "tpot_ms": run["lat"]["tpot_ms"],
            "pass_ms_per_step": 1e3 * run["pass_s_per_step"],
            "ms_per_proposed_token": 1e3 * run["s_per_proposed_token"],
        }
    for name in ("c64", "nano", "c16", "long"):
        if name in report["off"] and name in report.get("on", {}):
            summary[name] = {"off": report["off"][name], "on": report["on"][name],
                             "ratio": report["on"][name] / report["off"][name]}  # fmt: skip
    return summary


def _write(path: str, report: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
