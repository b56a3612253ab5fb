"""`ferrum bench throughput`: every prompt submitted at once, tokens per second (vLLM's flags).

Datasets: `random` (`--num-prompts` prompts of `--input-len` tokens, `--output-len` each; the
`c16`/`c64` recipe) and `nano` (input U[100, --input-len], output U[100, --output-len]; the
`nano` recipe). Both draw from `--seed`, which also seeds the engine."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ferrum.bench import workloads
from ferrum.bench.latency import timed_generate
from ferrum.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferrum.entrypoints.llm import LLM

DATASETS = ("random", "nano")
# dataset -> (input_len, output_len, num_prompts, temperature) when the flags are not given.
_DATASET_DEFAULTS = {"random": (1024, 128, 1000, 1.0), "nano": (1024, 1024, 256, 0.6)}
# The nano recipe draws lengths from U[100, max]: its maxima cannot be below this.
NANO_MIN_LEN = 100


@dataclass
class ThroughputResult:
    elapsed_time: float
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    # Prompt tokens served from the prefix cache (0 unless prompts share earlier ones' prefixes).
    num_cached_prompt_tokens: int
    requests_per_second: float
    tokens_per_second: float
    output_tokens_per_second: float

    @property
    def total_num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_num_tokens": self.total_num_tokens}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (model positional) plus the throughput flags; prompts are token ids."""
    from ferrum.engine.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser)
    parser.set_defaults(skip_tokenizer_init=True)
    parser.add_argument("--dataset-name", choices=DATASETS, default="random")
    parser.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="prompt tokens (nano: the largest); default 1024",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output tokens (nano: the largest); default random 128, nano 1024",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="default random 1000, nano 256"
    )
    parser.add_argument(
        "--temperature", type=float, default=None, help="default random 1.0, nano 0.6; 0 = greedy"
    )
    parser.add_argument("--output-json", default=None, help="write the figures to this file")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from ferrum.default_model import DEFAULT_MODEL_DIR
    from ferrum.engine.arg_utils import EngineArgs
    from ferrum.entrypoints.llm import LLM

    input_len, output_len, num_prompts, temperature = _resolve_args(args)
    engine_args = EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR)
    llm = LLM(**vars(engine_args))
    vocab_size = llm.llm_engine.config.model_config.vocab_size
    if args.dataset_name == "nano":
        prompts, output_lens = workloads.nano(args.seed, num_prompts, input_len, output_len)
    else:
        prompts, output_lens = workloads.batch(num_prompts, input_len, output_len, args.seed)
    prompts = workloads.fold_to_vocab(prompts, vocab_size)
    result = measure_throughput(
        llm, prompts, output_lens, temperature, show_progress=not args.disable_tqdm
    )
    print(
        f"Throughput: {result.requests_per_second:.2f} requests/s, "
        f"{result.tokens_per_second:.2f} total tokens/s, "
        f"{result.output_tokens_per_second:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {result.num_prompt_tokens}")
    print(f"Total num output tokens:  {result.num_output_tokens}")
    print(f"Elapsed time: {result.elapsed_time:.3f} s")
    if args.output_json:
        output = result.to_dict()
        output["engine_args"] = vars(engine_args)
        output["bench_args"] = {
            "dataset_name": args.dataset_name,
            "input_len": input_len,
            "output_len": output_len,
            "num_prompts": num_prompts,
            "temperature": temperature,
            "seed": args.seed,
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(output, f, indent=2)
    return 0


def measure_throughput(
    llm: LLM,
    prompts: list[list[int]],
    output_lens: list[int],
    temperature: float,
    show_progress: bool = True,
) -> ThroughputResult:
    """One `generate` call over every prompt (`ignore_eos`, max_tokens from `output_lens`), with
    its progress bar (requests done, tokens/s) unless told; unseeded requests draw from the
    engine's seeded generator."""
    if len(prompts) != len(output_lens):
        raise ValueError(f"output_lens: got {len(output_lens)} for {len(prompts)} prompts")
    params = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n) for n in output_lens
    ]
    elapsed, outputs = timed_generate(llm, prompts, params, use_tqdm=show_progress)
    num_output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_prompt_tokens = sum(len(p) for p in prompts)
    return ThroughputResult(
        elapsed_time=elapsed,
        num_requests=len(prompts),
        num_prompt_tokens=num_prompt_tokens,
        num_output_tokens=num_output_tokens,
        num_cached_prompt_tokens=sum(o.num_cached_tokens for o in outputs),
        requests_per_second=len(prompts) / elapsed,
        tokens_per_second=(num_prompt_tokens + num_output_tokens) / elapsed,
        output_tokens_per_second=num_output_tokens / elapsed,
    )


def _resolve_args(args: argparse.Namespace) -> tuple[int, int, int, float]:
    default_in, default_out, default_num, default_temperature = _DATASET_DEFAULTS[args.dataset_name]
    input_len = default_in if args.input_len is None else args.input_len
    output_len = default_out if args.output_len is None else args.output_len
    num_prompts = default_num if args.num_prompts is None else args.num_prompts
    temperature = default_temperature if args.temperature is None else args.temperature
    minimum = NANO_MIN_LEN if args.dataset_name == "nano" else 1
    for name, value in (("input_len", input_len), ("output_len", output_len)):
        if value < minimum:
            raise ValueError(
                f"{name} must be >= {minimum} for dataset {args.dataset_name!r}, got {value}"
            )
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    return input_len, output_len, num_prompts, temperature
