"""`ferrum generate --enable-lora --lora-path FOLDER`: every prompt runs with the adapter."""

from __future__ import annotations

import pytest

from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.entrypoints.cli import main
from tests.utils.lora_adapters import make_peft_adapter

ARGS = ["generate", "--prompt", "Once upon a time", "--max-tokens", "6", "--ignore-eos"]
ENGINE = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32"]


def test_generate_with_an_adapter(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    adapter = make_peft_adapter(DEFAULT_MODEL_DIR, tmp_path / "adapter", rank=4, seed=3)
    assert main([*ARGS, *ENGINE]) == 0
    base = capsys.readouterr().out
    assert (
        main([*ARGS, *ENGINE, "--enable-lora", "--max-lora-rank", "8", "--lora-path", adapter]) == 0
    )
    tuned = capsys.readouterr().out
    assert "[length, 6 tokens]" in tuned and tuned != base
    assert main([*ARGS, *ENGINE, "--lora-path", adapter]) != 0
    assert "need enable_lora=True (--enable-lora)" in capsys.readouterr().err
