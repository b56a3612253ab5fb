"""The `ferrum` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
    code = main(["generate", "/nonexistent/model", "--device", "cpu"])
    assert code == 2
    assert "is not a local model folder" in capsys.readouterr().err
