"""Session-wide fixtures shared by all test packages."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter; triton reads this when it is imported.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from tests.utils.tiny_checkpoints import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """Factory `tiny_checkpoint(arch, **overrides) -> path`: builds each distinct tiny HF
    checkpoint once per session (see tests/utils/tiny_checkpoints.py) and returns its folder.
    Callers must not modify the folder; copy it first."""
    root = tmp_path_factory.mktemp("tiny_checkpoints")
    built: dict[str, str] = {}

    def build(arch: str, **overrides: Any) -> str:
        key = f"{arch}-{sorted(overrides.items())!r}"
        if key not in built:
            digest = hashlib.sha1(key.encode()).hexdigest()[:10]
            built[key] = make_tiny_checkpoint(root / f"{arch}-{digest}", arch, **overrides)
        return built[key]

    return build


@pytest.fixture(scope="session")
def peft_adapter(
    tiny_checkpoint: Callable[..., str], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., str]:
    """Factory `peft_adapter(arch, **options) -> folder`: a random PEFT LoRA adapter of the tiny
    `arch` checkpoint (tests/utils/lora_adapters.py), built once per session per options."""
    from tests.utils.lora_adapters import make_peft_adapter

    root = tmp_path_factory.mktemp("peft_adapters")
    built: dict[str, str] = {}

    def build(arch: str, **options: Any) -> str:
        key = f"{arch}-{sorted(options.items())!r}"
        if key not in built:
            digest = hashlib.sha1(key.encode()).hexdigest()[:10]
            built[key] = make_peft_adapter(tiny_checkpoint(arch), root / digest, **options)
        return built[key]

    return build


@pytest.fixture(scope="session")
def shipped_llm() -> Any:
    """The shipped trained model (ferrum/model_files) as an fp32 CPU `LLM` with its tokenizer,
    shared by the session: tests must leave it with no unfinished request."""
    from ferrum import LLM
    from ferrum.default_model import DEFAULT_MODEL_DIR

    return LLM(
        DEFAULT_MODEL_DIR, dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=512
    )


@pytest.fixture(scope="session")
def gloo_ranks() -> Any:
    """Two gloo rank processes (tests/utils/rank_pool.py) for every test module that runs a
    function on each rank: started once (about 1.5 s on two cores), closed at the end."""
    from tests.utils.rank_pool import RankPool

    ranks = RankPool(2)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def one_torch_thread() -> Any:
    """torch on one intra-op thread for a module, restored afterwards: the tiny models' small
    ops gain nothing from more, and on a loaded 2-core machine spinning OpenMP workers make
    every decode step many times slower (~10x measured on the structured-output tests)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
