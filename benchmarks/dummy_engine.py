"""The engine set-up shared by the step profilers: every engine flag, dummy bf16 weights,
token-id prompts (no tokenizer), and the batch-shape flags."""

import argparse

from ferrum.engine.arg_utils import EngineArgs
from ferrum.entrypoints.llm import LLM


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
