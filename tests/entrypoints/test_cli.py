"""The `ferrum` command line."""

from __future__ import annotations

import io
import socket
import subprocess
import sys

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
        main(["serve", "--enable-lora"])
    err = capsys.readouterr().err
    assert err.startswith("usage: ferrum serve")
    assert "--enable-lora: not supported yet by ferrum" in err


def test_help_states_defaults() -> None:
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]

    def help_of(name: str) -> str:
        return " ".join(subcommands[name].format_help().split())

    generate_help = help_of("generate")
    assert "(default: 64)" in generate_help and "temperature 0 (greedy decoding)" in generate_help
    serve_help = help_of("serve")
    assert "(default: 127.0.0.1)" in serve_help and "(default: 8000)" in serve_help
    run_help = help_of("run")
    assert "max_new_tokens, else 512" in run_help


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
