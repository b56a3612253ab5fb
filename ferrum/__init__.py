"""ferrum: an LLM inference and serving engine.

The public names are imported lazily, so `import ferrum.scheduler` (or the CLI's `--version`)
does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ferrum import envs

__version__ = "0.1.0"

envs.prefer_passive_openmp()

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

_LAZY = {
    "LLM": "ferrum.entrypoints.llm",
    "CompletionOutput": "ferrum.outputs",
    "Logprob": "ferrum.outputs",
    "LoRARequest": "ferrum.lora_request",
    "RequestOutput": "ferrum.outputs",
    "SamplingParams": "ferrum.sampling_params",
}

if TYPE_CHECKING:
    from ferrum.entrypoints.llm import LLM
    from ferrum.lora_request import LoRARequest
    from ferrum.outputs import CompletionOutput, Logprob, RequestOutput
    from ferrum.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ferrum' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
