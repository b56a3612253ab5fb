"""Kernel tests run on CUDA when present, else on CPU under the Triton interpreter.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here, before any test module
imports triton or a ferrum kernel. Without triton installed the test modules here are not
collected and the run header says so. A test taking a `dtype` argument runs in fp32 and fp16
everywhere and in bf16 on CUDA only (the interpreter mishandles bf16).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

HAS_TRITON = importlib.util.find_spec("triton") is not None
if not HAS_TRITON:
    collect_ignore_glob = ["test_*.py"]

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def pytest_configure(config: pytest.Config) -> None:
    # The triton 3.6 interpreter converts 1-element arrays to Python ints (numpy >= 1.25 warns).
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning"
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    if not HAS_TRITON:
        return "triton is not installed: tests/kernels skipped"
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    explicit = any(
        "dtype" in str(m.args[0]) for m in metafunc.definition.iter_markers("parametrize")
    )
    if "dtype" in metafunc.fixturenames and not explicit:
        needs_cuda = pytest.mark.skipif(
            not torch.cuda.is_available(), reason="bf16 runs only on CUDA"
        )
        params = [
            pytest.param(d, marks=needs_cuda) if d == torch.bfloat16 else d for d in KERNEL_DTYPES
        ]
        metafunc.parametrize("dtype", params, ids=lambda d: str(d).removeprefix("torch."))


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _packaged_tables_only():
    """Kernel tests read the packaged tile tables, never this machine's tuned ones (an engine
    started earlier in the session points the lookup at them)."""
    from ferrum.kernels.tuned_tables import set_user_config_dir, user_config_dir

    before = user_config_dir()
    set_user_config_dir(None)
    yield
    set_user_config_dir(before)
