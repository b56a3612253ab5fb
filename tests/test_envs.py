"""envs.py: importing ferrum makes torch's idle CPU threads sleep (OMP_WAIT_POLICY=PASSIVE)
unless the user chose a policy, or torch was imported first (then it is left alone)."""

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
