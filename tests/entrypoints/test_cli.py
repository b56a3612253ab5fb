"""The `ferrum` command line."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferrum.entrypoints.cli import build_parser, main


def test_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ferrum", "--version"], capture_output=True, text=True, check=True
    )
    assert result.stdout.startswith("ferrum 0.")


def test_engine_flags_use_vllm_names() -> None:
    args = build_parser().parse_args(
        [
            "generate",
            "some/model",
            "--max-model-len",
            "64",
            "--max-num-seqs",
            "3",
            "--no-enable-prefix-caching",
            "--num-kv-blocks",
            "9",
            "--load-format",
            "dummy",
        ]
    )
    assert (args.model, args.max_model_len, args.max_num_seqs) == ("some/model", 64, 3)
    assert (args.enable_prefix_caching, args.num_kv_blocks, args.load_format) == (False, 9, "dummy")


def test_generate_with_the_shipped_model(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "generate",
            "--prompt",
            "Once upon a time",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--device",
            "cpu",
            "--num-kv-blocks",
            "32",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "[length, 5 tokens]" in out and "Once upon a time" in out


def test_bad_flag_values_give_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--prompt", "x", "--top-p", "2", "--device", "cpu"])
    assert code == 2
    assert "SamplingParams.top_p must be a number in (0, 1]" in capsys.readouterr().err
    code = main(["generate", "/nonexistent/model", "--prompt", "x", "--device", "cpu"])
    assert code == 2
    assert "is not a local model folder" in capsys.readouterr().err


def test_unknown_flag_shows_the_subcommand_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", "--no-such-flag"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("usage: ferrum generate") and "unrecognized arguments: --no-such-flag" in err
    )


def test_vllm_flags_not_supported_yet_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--revision", "main"])
    err = capsys.readouterr().err
    assert err.startswith("usage: ferrum serve")
    assert "--revision: not supported yet by ferrum" in err


def test_help_states_defaults() -> None:
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]

    def help_of(name: str) -> str:
        return " ".join(subcommands[name].format_help().split())

    generate_help = help_of("generate")
    assert "(default: 64)" in generate_help and "temperature 0 (greedy decoding)" in generate_help
    assert "--temperature TEMPERATURE 0 = greedy decoding (default: 0.0)" in generate_help
    assert "--top-p TOP_P (default: 1.0)" in generate_help
    assert "--repetition-penalty REPETITION_PENALTY (default: 1.0)" in generate_help
    serve_help = help_of("serve")
    assert "(default: 127.0.0.1)" in serve_help and "(default: 8000)" in serve_help
    run_help = help_of("run")
    assert "max_new_tokens, else 512" in run_help
    assert "--top-p TOP_P (default: the model's generation_config.json value, else 1.0)" in run_help


def test_generate_reads_a_piped_prompt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time\n"))
    code = main(["generate", "--max-tokens", "3", "--ignore-eos", "--device", "cpu"])
    assert code == 0
    assert "--- prompt: 'Once upon a time'  [length, 3 tokens]" in capsys.readouterr().out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_generate_without_a_prompt_on_a_terminal_asks_for_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", _Terminal())
    assert main(["generate", "--device", "cpu"]) == 2
    assert "--prompt is needed" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--prompt", "x", "--device", "cuda"],
        ["run", "Hello", "--device", "cuda"],
        ["serve", "--device", "cuda", "--port", "1"],
    ],
)
def test_cuda_without_cuda_is_one_clear_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ferrum: error: device: 'cuda' was asked for") and err.count("\n") == 1


def test_serve_on_a_busy_port_fails_before_loading_the_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The model does not exist: the port is checked first.
        assert main(["serve", "/no/such/model", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"port: cannot listen on 127.0.0.1:{port}" in err and "model" not in err


@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_api_key_is_refused(key: str, capsys: pytest.CaptureFixture[str]) -> None:
    # `--api-key "$KEY"` with KEY unset must not serve without authentication.
    assert main(["serve", "/no/such/model", "--api-key", key]) == 2
    err = capsys.readouterr().err
    assert "api_key: --api-key is empty" in err and "drop --api-key" in err


def test_generate_n_prints_each_completion_index(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--prompt", "Hi", "--n", "2", "--max-tokens", "2", "--ignore-eos"]
    assert main([*argv, "--temperature", "1", "--device", "cpu", "--num-kv-blocks", "32"]) == 0
    out = capsys.readouterr().out
    assert "--- prompt: 'Hi'  completion 0  [length, 2 tokens]" in out
    assert "--- prompt: 'Hi'  completion 1  [length, 2 tokens]" in out


def test_underscore_spellings_are_accepted() -> None:
    from ferrum.entrypoints.cli_args import normalize_flag_spellings

    argv = ["serve", "--max_model_len", "64", "--served_model_name=a_b", "--", "--x_y"]
    assert normalize_flag_spellings(argv) == [
        "serve",
        "--max-model-len",
        "64",
        "--served-model-name=a_b",
        "--",
        "--x_y",
    ]
    args = build_parser().parse_args(normalize_flag_spellings(["serve", "--max_num_seqs", "3"]))
    assert args.max_num_seqs == 3


VLLM_LAUNCH_FLAGS = [
    "--enable-chunked-prefill",
    "--cpu-offload-gb=0",
    "--swap-space=4",
    "--trust-remote-code",
    "--disable-log-stats",
    "--max-logprobs=5",
    "--disable-log-requests",
    "--generation-config=vllm",
    "--tokenizer-mode=auto",
    "--response-role=bot",
    "--root-path=/api",
    "--return-tokens-as-token-ids",
    "--max-seq-len-to-capture=8192",
    "-O0",
    "--max_model_len=256",
]


def test_a_vllm_launch_script_parses() -> None:
    from ferrum.entrypoints.cli_args import normalize_flag_spellings

    args = build_parser().parse_args(normalize_flag_spellings(["serve", *VLLM_LAUNCH_FLAGS]))
    assert (args.enable_chunked_prefill, args.cpu_offload_gb, args.swap_space) == (True, 0, 4)
    assert (args.max_logprobs, args.optimization_level, args.max_model_len) == (5, 0, 256)
    assert (args.response_role, args.root_path, args.return_tokens_as_token_ids) == (
        "bot",
        "/api",
        True,
    )


def test_config_file_values_are_defaults_that_flags_override(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ferrum.entrypoints.cli_args import apply_config_file

    config = tmp_path / "config.yaml"
    config.write_text(
        "model: some/model\nmax_model_len: 256\nmax-num-seqs: 4\nenable-prefix-caching: false\n"
        "served-model-name: [a, b]\nallowed-origins: ['http://x']\n"
        "structured-outputs-config: {disable_any_whitespace: true}\ntrust-remote-code: true\n"
    )
    parser = build_parser()
    argv = ["serve", "--config", str(config), "--max-num-seqs", "8"]
    args = parser.parse_args(argv)
    apply_config_file(args.parser, args.config)
    args = parser.parse_args(argv)
    assert (args.model, args.max_model_len, args.max_num_seqs) == ("some/model", 256, 8)
    assert (args.enable_prefix_caching, args.served_model_name) == (False, ["a", "b"])
    assert args.allowed_origins == ["http://x"] and args.trust_remote_code is True
    assert args.structured_outputs_config == {"disable_any_whitespace": True}
    for text, message in (
        ("max-model-len: many\n", "argument --max-model-len: invalid int value: 'many'"),
        ("no-such-flag: 1\n", "'no-such-flag' is not a flag of this command"),
        ("revision: main\n", "'revision' is not supported yet by ferrum"),
        ("[1, 2]\n", "must hold a mapping of flag names to values"),
    ):
        config.write_text(text)
        assert main(["serve", "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"ferrum: error: config: '{config}'") and message in err, err
    assert main(["serve", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "config: cannot read" in capsys.readouterr().err


def test_an_invalid_log_level_is_one_clear_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ferrum", "serve"],
        capture_output=True,
        text=True,
        env={**os.environ, "FERRUM_LOGGING_LEVEL": "verbose"},
    )
    assert result.returncode == 2
    assert result.stderr == (
        "ferrum: error: FERRUM_LOGGING_LEVEL='verbose' is not a log level; use one of DEBUG, "
        "INFO, WARNING, ERROR, CRITICAL\n"
    )


def test_refused_vllm_flags_name_why(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--no-enable-chunked-prefill"], "enable_chunked_prefill: False is not supported"),
        (["--cpu-offload-gb", "4"], "cpu_offload_gb: 4 GiB: not supported yet"),
        (["--tokenizer-mode", "slow"], "tokenizer_mode: 'slow' is not supported"),
    ):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        assert main(["serve", *argv, "--device", "cpu", "--port", str(port)]) == 2
        assert message in capsys.readouterr().err


def test_building_the_parser_imports_no_torch_triton_or_web_framework() -> None:
    """`ferrum tune` and `bench` on a GPU host need neither the server's web stack nor, until
    they run, torch: the parser of every command is built from argparse-only modules."""
    code = (
        "import sys; from ferrum.entrypoints.cli import build_parser; build_parser(); "
        "print(sorted(m.split('.')[0] for m in sys.modules))"
    )
    modules = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    for heavy in ("torch", "triton", "fastapi", "uvicorn", "starlette"):
        assert f"'{heavy}'" not in modules, heavy
    assert "'ferrum'" in modules
