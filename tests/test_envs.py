"""envs.py: importing ferrum makes torch's idle CPU threads sleep (OMP_WAIT_POLICY=PASSIVE)
unless the user chose a policy, or torch was imported first (then it is left alone); the tuned
tables' folder."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PRINT_POLICY = "import os; {first}import ferrum; print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize(
    ("env", "first", "policy"),
    [
        ({}, "", "PASSIVE"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "", "ACTIVE"),
        ({}, "import torch; ", "None"),
    ],
    ids=["default", "the user's", "torch first"],
)
def test_importing_ferrum_prefers_passive_openmp(env: dict, first: str, policy: str) -> None:
    environment = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, "-c", PRINT_POLICY.format(first=first)],
        env=environment | env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == policy


def test_tuned_config_dir_is_the_debug_override_else_the_xdg_cache(monkeypatch, tmp_path) -> None:
    from pathlib import Path

    from ferrum import envs

    monkeypatch.delenv("FERRUM_TUNED_CONFIG_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.tuned_config_dir() == tmp_path / "ferrum" / "tuned_configs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert envs.tuned_config_dir() == Path.home() / ".cache" / "ferrum" / "tuned_configs"
    monkeypatch.setenv("FERRUM_TUNED_CONFIG_DIR", str(tmp_path / "mine"))
    assert envs.tuned_config_dir() == tmp_path / "mine"


def test_flash_attn4_kernels_persist_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # noqa: ANN001
    from ferrum import envs

    enabled, folder = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"
    monkeypatch.delenv(enabled, raising=False)
    monkeypatch.delenv(folder, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    envs.persist_flash_attn4_kernels()
    assert os.environ[enabled] == "1"
    assert os.environ[folder] == str(tmp_path / "ferrum" / "flash_attn4")
    monkeypatch.setenv(enabled, "0")
    monkeypatch.delenv(folder)
    envs.persist_flash_attn4_kernels()
    assert os.environ[enabled] == "0" and folder not in os.environ
