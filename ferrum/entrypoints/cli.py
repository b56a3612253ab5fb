"""The `ferrum` command: `ferrum generate [MODEL] --prompt ...`, `ferrum serve [MODEL]`,
`ferrum run [MODEL] [PROMPT]`, `ferrum bench ...`, `ferrum tune [MODEL]`, `ferrum --version`."""

from __future__ import annotations

import argparse
import sys

from ferrum.default_model import DEFAULT_MODEL_DIR

GENERATE_MAX_TOKENS = 64


def _add_generate_sampling_args(parser: argparse.ArgumentParser) -> None:
    from ferrum.entrypoints.sampling_args import add_sampling_args

    add_sampling_args(
        parser,
        str(GENERATE_MAX_TOKENS),
        "SamplingParams' defaults, except temperature 0 (greedy decoding)",
        overrides={"temperature": 0.0},
    )
    parser.add_argument("--n", type=int, default=1, help="completions per prompt (default: 1)")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")


def _read_prompts(args: argparse.Namespace) -> list[str]:
    """The --prompt values, else standard input (one prompt) when it is piped."""
    if args.prompt:
        return args.prompt
    if sys.stdin is None or sys.stdin.isatty():
        raise ValueError("--prompt is needed (or pipe the prompt on standard input)")
    text = sys.stdin.read().removesuffix("\n")
    if not text.strip():
        raise ValueError("prompt: standard input was empty; give --prompt or pipe a prompt")
    return [text]


def _generate(args: argparse.Namespace) -> int:
    from ferrum import LLM, LoRARequest, SamplingParams
    from ferrum.engine.arg_utils import EngineArgs
    from ferrum.entrypoints.sampling_args import sampling_overrides

    prompts = _read_prompts(args)
    engine_args = EngineArgs.from_cli_args(args, DEFAULT_MODEL_DIR)
    params = SamplingParams(
        n=args.n,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        **({"max_tokens": GENERATE_MAX_TOKENS, "temperature": 0.0} | sampling_overrides(args)),
    )
    llm = LLM(**vars(engine_args))
    lora = None if args.lora_path is None else LoRARequest("adapter", 1, args.lora_path)
    if args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": p}] for p in prompts],
            params,
            use_tqdm=False,
            lora_request=lora,
        )
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    for prompt, output in zip(prompts, outputs):
        for completion in output.outputs:
            index = f"completion {completion.index}  " if args.n > 1 else ""
            print(
                f"--- prompt: {prompt!r}  {index}[{completion.finish_reason}, "
                f"{len(completion.token_ids)} tokens]"
            )
            print(prompt + completion.text if not args.chat else completion.text)
    return 0


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    from ferrum.engine.arg_utils import EngineArgs, add_config_args
    from ferrum.entrypoints.openai.frontend_args import FrontendConfig
    from ferrum.entrypoints.openai.http_limits import HttpLimits
    from ferrum.entrypoints.openai.lora_args import add_lora_args
    from ferrum.entrypoints.openai.server_config import ServerConfig
    from ferrum.recovery_config import EngineRecoveryConfig

    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: MODEL as given, or the shipped model's name)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every route but /health and /version",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (its access log is at info; default: info)",
    )
    add_lora_args(parser)
    add_config_args(parser.add_argument_group("TLS, root path and logs"), ServerConfig)
    add_config_args(parser.add_argument_group("HTTP limits (refusals: 408, 413, 503)"), HttpLimits)
    FrontendConfig.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)
    add_config_args(parser, EngineRecoveryConfig)


def _serve(args: argparse.Namespace) -> int:
    from ferrum.entrypoints.openai.server import run_server

    return run_server(args)


def _run(args: argparse.Namespace) -> int:
    from ferrum.entrypoints.run_chat import run_chat

    return run_chat(args)


def build_parser() -> argparse.ArgumentParser:
    from ferrum import __version__
    from ferrum.engine.arg_utils import EngineArgs
    from ferrum.entrypoints.cli_args import add_config_file_arg

    parser = argparse.ArgumentParser(prog="ferrum", description="ferrum LLM inference engine")
    parser.add_argument("--version", action="version", version=f"ferrum {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    generate = commands.add_parser(
        "generate",
        help="generate text for one or more prompts and exit",
        description="Offline generation. MODEL defaults to the small model shipped with ferrum.",
    )
    EngineArgs.add_cli_args(generate)
    generate.add_argument(
        "--prompt",
        action="append",
        help="prompt text (repeatable; default: standard input, when it is piped)",
    )
    generate.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    generate.add_argument(
        "--lora-path",
        default=None,
        help="run every prompt with this LoRA adapter (a PEFT folder; needs --enable-lora)",
    )
    _add_generate_sampling_args(generate)
    add_config_file_arg(generate)
    generate.set_defaults(handler=_generate, parser=generate)
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="OpenAI-compatible server. MODEL defaults to the small model shipped with "
        "ferrum.",
    )
    _add_serve_args(serve)
    add_config_file_arg(serve)
    serve.set_defaults(handler=_serve, parser=serve)
    run = commands.add_parser(
        "run",
        help="chat with a model in the terminal",
        description="Interactive chat (or one answer with PROMPT). MODEL defaults to the small "
        "model shipped with ferrum.",
    )
    from ferrum.entrypoints.run_chat import add_run_args

    add_run_args(run)
    add_config_file_arg(run)
    run.set_defaults(handler=_run, parser=run)
    _add_bench_commands(commands)
    _add_tune_command(commands)
    return parser


def _add_tune_command(commands: argparse._SubParsersAction) -> None:
    from ferrum.bench import tune_args

    sub = commands.add_parser(
        "tune",
        help="time kernel tiles on this GPU and write its tuned tables (resumable)",
        description=tune_args.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune_args.add_cli_args(sub)
    sub.set_defaults(handler=_tune, parser=sub)


def _tune(args: argparse.Namespace) -> int:
    from ferrum.bench.tune import main as run_tune

    return run_tune(args)


def _add_bench_commands(commands: argparse._SubParsersAction) -> None:
    from ferrum.bench import compare, latency, serve, throughput

    bench = commands.add_parser(
        "bench", help="benchmarks: latency, throughput (offline), serve (a live server), compare"
    )
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name, module in (
        ("latency", latency),
        ("throughput", throughput),
        ("serve", serve),
        ("compare", compare),
    ):
        sub = bench_commands.add_parser(name, help=module.__doc__.splitlines()[0])
        module.add_cli_args(sub)
        sub.set_defaults(handler=module.main, parser=sub)


def main(argv: list[str] | None = None) -> int:
    from ferrum import envs

    try:
        envs.logging_level()
    except ValueError as e:
        print(f"ferrum: error: {e}", file=sys.stderr)
        return 2
    from ferrum.entrypoints.cli_args import apply_config_file, normalize_flag_spellings

    argv = normalize_flag_spellings(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "config", None):
        try:
            apply_config_file(args.parser, args.config)
        except ValueError as e:
            print(f"ferrum: error: {e}", file=sys.stderr)
            return 2
        args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The subcommand's usage, not the top-level one.
        args.parser.error(_unknown_args_message(unknown))
    if getattr(args, "kernel_backend", None) == "triton" and getattr(args, "device", None) == "cpu":
        from ferrum.model_executor.kernel_backend import enable_triton_interpreter

        enable_triton_interpreter()  # before anything imports triton
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"ferrum: error: {e}", file=sys.stderr)
        return 2


def _unknown_args_message(unknown: list[str]) -> str:
    from ferrum.engine.arg_utils import NOT_SUPPORTED_YET

    for arg in unknown:
        name = arg.split("=", 1)[0].removeprefix("--").replace("-", "_")
        if arg.startswith("--") and name in NOT_SUPPORTED_YET:
            return f"{arg.split('=', 1)[0]}: not supported yet by ferrum (see the README)"
    return f"unrecognized arguments: {' '.join(unknown)}"


if __name__ == "__main__":
    sys.exit(main())
