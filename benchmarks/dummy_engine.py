"""The engine set-up shared by the step profilers: every engine flag, dummy bf16 weights,
token-id prompts (no tokenizer), the batch-shape flags, and a batch brought to steady decode."""

import argparse

from ferrum.engine.arg_utils import EngineArgs
from ferrum.engine.llm_engine import LLMEngine
from ferrum.entrypoints.llm import LLM
from ferrum.sampling_params import RequestOutputKind, SamplingParams


def engine_parser(description: str) -> argparse.ArgumentParser:
    """Engine flags (defaults: dummy weights, no tokenizer, bf16) plus --num-prompts,
    --input-len and --temperature."""
    parser = argparse.ArgumentParser(description=description)
    EngineArgs.add_cli_args(parser, model_positional=False)
    parser.set_defaults(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    return parser


def make_llm(args: argparse.Namespace) -> LLM:
    return LLM(**vars(EngineArgs.from_cli_args(args, args.model)))


def start_decoding(
    engine: LLMEngine,
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float,
    num_settle_steps: int = 5,
) -> list[str]:
    """Adds the token-id prompts as requests of `max_tokens` output tokens each (ignoring EOS),
    steps until every prompt is prefilled, then `num_settle_steps` more: from there on each step
    decodes the whole batch until a request reaches max_tokens. Returns the request ids (for
    `engine.abort_request`)."""
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=temperature,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    req_ids = [f"decode-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(req_ids, prompts):
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    scheduler = engine.core.scheduler
    while scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        engine.step()
    for _ in range(num_settle_steps):
        engine.step()
    return req_ids
