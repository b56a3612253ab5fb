"""Typed, validated engine configuration. Every knob is a field here and a CLI flag of the same name."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("float32", "float16", "bfloat16")
_DTYPE_ALIASES = {
    "float": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
# generation_config.json keys that become SamplingParams defaults (max_new_tokens -> max_tokens).
_GENERATION_DEFAULTS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)
KERNEL_BACKENDS = ("auto", "torch", "triton")


def _fail(field_name: str, message: str) -> ValueError:
    return ValueError(f"{field_name}: {message}")


def read_hf_config(model: str) -> dict[str, Any]:
    """Reads `config.json` from a local Hugging Face model folder."""
    if not os.path.isdir(model):
        raise _fail("model", f"{model!r} is not a local model folder (no model hub is used)")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise _fail("model", f"{model!r} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _fail("model", f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise _fail("model", f"{path} does not hold a JSON object")
    return config


@dataclass(frozen=True)
class ModelConfig:
    model: str
    hf_config: dict[str, Any]
    dtype: str
    max_model_len: int
    tokenizer: str
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    seed: int = 0

    @classmethod
    def from_args(
        cls,
        model: str,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        tokenizer: str | None = None,
        load_format: str = "auto",
        skip_tokenizer_init: bool = False,
        seed: int = 0,
    ) -> ModelConfig:
        hf_config = read_hf_config(model)
        if not isinstance(hf_config.get("architectures"), list) or not hf_config["architectures"]:
            raise _fail("model", f"config.json of {model!r} names no `architectures`")
        if load_format not in LOAD_FORMATS:
            raise _fail("load_format", f"must be one of {LOAD_FORMATS}, got {load_format!r}")
        derived_len = int(hf_config.get("max_position_embeddings") or 2048)
        if max_model_len is None:
            max_model_len = derived_len
        elif not isinstance(max_model_len, int) or max_model_len < 1:
            raise _fail("max_model_len", f"must be a positive integer, got {max_model_len!r}")
        elif max_model_len > derived_len:
            raise _fail(
                "max_model_len",
                f"{max_model_len} exceeds the model's max_position_embeddings={derived_len}",
            )
        return cls(
            model=model,
            hf_config=hf_config,
            dtype=resolve_dtype(dtype, hf_config),
            max_model_len=max_model_len,
            tokenizer=tokenizer or model,
            load_format=load_format,
            skip_tokenizer_init=skip_tokenizer_init,
            seed=seed,
        )

    @property
    def architecture(self) -> str:
        return self.hf_config["architectures"][0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def num_hidden_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        head_dim = self.hf_config.get("head_dim")
        return (
            int(head_dim)
            if head_dim
            else int(self.hf_config["hidden_size"]) // self.num_attention_heads
        )

    def generation_config(self) -> dict[str, Any]:
        """generation_config.json of the model folder ({} when absent or unreadable)."""
        path = os.path.join(self.model, "generation_config.json")
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError):
            return {}
        return config if isinstance(config, dict) else {}

    def default_sampling_kwargs(self) -> dict[str, Any]:
        """The model's recommended sampling values, as SamplingParams keyword arguments."""
        generation = self.generation_config()
        names = {name: name for name in _GENERATION_DEFAULTS}
        names["max_new_tokens"] = "max_tokens"
        return {names[k]: v for k, v in generation.items() if k in names and v is not None}

    def eos_token_ids(self) -> list[int]:
        """EOS ids from generation_config.json (as HF `generate` uses), else config.json."""
        ids: Any = self.generation_config().get("eos_token_id")
        if ids is None:
            ids = self.hf_config.get("eos_token_id")
        if ids is None:
            return []
        return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def resolve_dtype(dtype: str, hf_config: dict[str, Any]) -> str:
    """ "auto" takes the checkpoint's dtype (float32 when it names none)."""
    if dtype == "auto":
        dtype = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    dtype = dtype.removeprefix("torch.")
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in _DTYPES:
        raise _fail("dtype", f"must be 'auto' or one of {_DTYPES}, got {dtype!r}")
    return dtype


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Fixes the KV pool size (block 0 is reserved as the padding block); None sizes it from memory.
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    # KV pool budget in bytes on the CPU (and on the GPU when set); None: 4 GiB on the CPU.
    kv_cache_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size > 1024:
            raise _fail("block_size", f"must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2
        ):
            raise _fail("num_kv_blocks", f"must be an integer >= 2, got {self.num_kv_blocks!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise _fail(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise _fail(
                "kv_cache_memory_bytes", f"must be positive, got {self.kv_cache_memory_bytes!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # Schedule step N+1 while the device runs step N (its tokens reach the host one step later).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise _fail("max_num_seqs", f"must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise _fail(
                "max_num_batched_tokens",
                f"must be an integer >= 1, got {self.max_num_batched_tokens!r}",
            )


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    kernel_backend: str = "auto"
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise _fail("device", f"must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise _fail(
                "kernel_backend", f"must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
