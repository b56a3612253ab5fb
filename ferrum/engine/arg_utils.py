"""EngineArgs: the user-facing engine knobs, shared by `LLM(...)` and every CLI command.

Each field is an `LLM` keyword argument and a CLI flag of the same name in kebab-case
(`max_num_seqs` -> `--max-num-seqs`; booleans also get `--no-...`).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from ferrum.config import (
    KERNEL_BACKENDS,
    LOAD_FORMATS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)

_HELP = {
    "model": "path of a local Hugging Face model folder",
    "tokenizer": "tokenizer folder (default: the model folder)",
    "dtype": "weights and activations dtype: auto (the checkpoint's), float32, float16, bfloat16",
    "device": "cuda or cpu (default: cuda when available)",
    "load_format": "auto/safetensors: read the checkpoint; dummy: random weights of its shapes",
    "skip_tokenizer_init": "no tokenizer: prompts must be token ids and outputs have no text",
    "max_model_len": "longest prompt + output in tokens (default: max_position_embeddings)",
    "block_size": "tokens per KV cache block",
    "num_kv_blocks": "fix the KV pool size in blocks (default: sized from memory)",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (weights + KV cache)",
    "kv_cache_memory_bytes": "KV pool budget in bytes (default on CPU: 4 GiB)",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (prompt chunks + decodes)",
    "seed": "seed of the engine's random generator (unseeded requests draw from it)",
    "kernel_backend": "auto (Triton on CUDA, torch elsewhere), torch, or triton",
    "enforce_eager": "never capture CUDA graphs",
    "async_scheduling": "schedule the next step while the device runs the current one "
    "(default: on with CUDA)",
}


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str | None = None
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    seed: int = 0
    kernel_backend: str = "auto"
    enforce_eager: bool = False
    async_scheduling: bool | None = None

    def create_engine_config(self) -> EngineConfig:
        model_config = ModelConfig.from_args(
            self.model,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
            load_format=self.load_format,
            skip_tokenizer_init=self.skip_tokenizer_init,
            seed=self.seed,
        )
        device = self.device or _default_device()
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            async_scheduling = device.startswith("cuda")
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            ),
            scheduler_config=SchedulerConfig(
                max_model_len=model_config.max_model_len,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                async_scheduling=async_scheduling,
            ),
            device_config=DeviceConfig(
                device=device,
                kernel_backend=self.kernel_backend,
                enforce_eager=self.enforce_eager,
            ),
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
        """Adds one flag per field; the model is a positional argument (optional) unless told."""
        for f in fields(EngineArgs):
            if f.name == "model":
                if model_positional:
                    parser.add_argument("model", nargs="?", default=None, help=_HELP["model"])
                else:
                    parser.add_argument("--model", default=None, help=_HELP["model"])
                continue
            flag = "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": _HELP[f.name]}
            if f.type in ("bool", "bool | None"):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _parse_type(f.type)
                if f.name == "load_format":
                    kwargs["choices"] = LOAD_FORMATS
                elif f.name == "kernel_backend":
                    kwargs["choices"] = KERNEL_BACKENDS
            parser.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, default_model: str) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["model"] = values.get("model") or default_model
        return cls(**values)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


def _parse_type(annotation: str) -> type:
    base = annotation.split("|")[0].strip()
    return {"int": int, "float": float, "str": str}[base]


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
