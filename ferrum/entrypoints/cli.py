"""The `ferrum` command: `ferrum generate [MODEL] --prompt ...`, `ferrum --version`."""

from __future__ import annotations

import argparse
import sys

from ferrum.default_model import DEFAULT_MODEL_DIR


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")


def _generate(args: argparse.Namespace) -> int:
    from ferrum import LLM, SamplingParams
    from ferrum.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR)
    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["The"]
    llm = LLM(**vars(engine_args))
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False
        )
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        for completion in output.outputs:
            print(f"--- prompt: {prompt!r}  [{completion.finish_reason}, "
                  f"{len(completion.token_ids)} tokens]")
            print(prompt + completion.text if not args.chat else completion.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from ferrum import __version__
    from ferrum.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(prog="ferrum", description="ferrum LLM inference engine")
    parser.add_argument("--version", action="version", version=f"ferrum {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    generate = commands.add_parser(
        "generate",
        help="generate text for one or more prompts and exit",
        description="Offline generation. MODEL defaults to the small model shipped with ferrum.",
    )
    EngineArgs.add_cli_args(generate)
    generate.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    generate.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    _add_sampling_args(generate)
    generate.set_defaults(handler=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"ferrum: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
