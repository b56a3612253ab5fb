"""Typed, validated engine configuration: every knob is a field here and a CLI flag of its name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ferrum.config_fields import field_error as _fail
from ferrum.config_fields import field_help as _help
from ferrum.device_config import KERNEL_BACKENDS, DeviceConfig  # noqa: F401 (re-exported)
from ferrum.eagle3_config import Eagle3Config
from ferrum.lora_config import LoRAConfig, check_lora_fits
from ferrum.model_arch import ModelArchConfig
from ferrum.model_folder import read_generation_config, read_hf_config
from ferrum.parallel_config import ParallelConfig, check_parallel_fits_model
from ferrum.quant_config import QUANTIZATION_CHOICES, QuantConfig, resolve_quant_config
from ferrum.sampling_params import MAX_LOGPROBS
from ferrum.speculative_config import SpeculativeConfig, check_speculation_fits
from ferrum.structured_outputs_config import StructuredOutputsConfig

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


@dataclass(frozen=True)
class ModelConfig:
    """The model folder and how to load it. Construction reads config.json and
    generation_config.json once and resolves dtype "auto", max_model_len None and tokenizer None."""

    model: str = field(
        metadata=_help("path of a local Hugging Face model folder, or of a GGUF file")
    )
    tokenizer: str | None = field(
        default=None, metadata=_help("tokenizer folder (default: the model folder)")
    )
    dtype: str = field(
        default="auto",
        metadata=_help(
            "weights and activations dtype: auto (the checkpoint's), float32, float16, bfloat16"
        ),
    )
    load_format: str = field(
        default="auto",
        metadata=_help(
            "auto/safetensors: read the checkpoint; dummy: random weights of its shapes",
            choices=LOAD_FORMATS,
        ),
    )
    skip_tokenizer_init: bool = field(
        default=False,
        metadata=_help("no tokenizer: prompts must be token ids and outputs have no text"),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_help("longest prompt + output in tokens (default: max_position_embeddings)"),
    )
    seed: int = field(
        default=0,
        metadata=_help("seed of the engine's random generator (unseeded requests draw from it)"),
    )
    quantization: str | None = field(
        default=None,
        metadata=_help(
            "weight quantization: fp8 quantizes a bf16/fp16 checkpoint per 128x128 block while "
            "loading; the others name the checkpoint's format (default: its quantization_config)",
            choices=QUANTIZATION_CHOICES,
        ),
    )
    # Resolved: -1 (vLLM's "no limit") and values above it become MAX_LOGPROBS.
    max_logprobs: int = field(
        default=20, metadata=_help("most logprobs per token a request may ask for (-1: up to 20)")
    )
    generation_config: str = field(
        default="auto",
        metadata=_help(
            "sampling defaults: auto (the model folder's generation_config.json), vllm (none: "
            "SamplingParams' defaults), or a folder holding a generation_config.json"
        ),
    )
    hf_config: dict[str, Any] = field(init=False, repr=False, compare=False)
    arch: ModelArchConfig = field(init=False, repr=False, compare=False)
    # None: unquantized; else how the linear layers are quantized.
    quant_config: QuantConfig | None = field(init=False, repr=False, compare=False)
    # generation_config.json: EOS ids, and sampling defaults unless generation_config is "vllm".
    hf_generation_config: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        hf_config = read_hf_config(self.model)
        arch = ModelArchConfig.from_hf_config(hf_config)
        if self.load_format not in LOAD_FORMATS:
            raise _fail("load_format", f"must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = arch.max_position_embeddings
        elif not isinstance(max_model_len, int) or max_model_len < 1:
            raise _fail("max_model_len", f"must be a positive integer, got {max_model_len!r}")
        elif max_model_len > arch.max_position_embeddings:
            raise _fail(
                "max_model_len",
                f"{max_model_len} exceeds the model's "
                f"max_position_embeddings={arch.max_position_embeddings}",
            )
        quant_config = resolve_quant_config(self.quantization, hf_config)
        int4 = quant_config.int4 if quant_config is not None else None
        if int4 is not None and int4.act_order and arch.num_experts > 0:
            raise _fail(
                "quantization",
                f"int4 act-order experts ({arch.architecture}) are not supported yet; "
                "supported: experts without desc_act / actorder group",
            )
        if (
            quant_config is not None
            and arch.num_experts > 0
            and quant_config.weight_scales not in ("block", "int4")
        ):
            raise _fail(
                "quantization",
                f"FP8 mixture-of-experts models ({arch.architecture}) with "
                f"{quant_config.weight_scales} weight scales are not supported yet; supported: "
                "128x128 block scales (Qwen's FP8 checkpoints, or quantization='fp8')",
            )
        resolved = {
            "hf_config": hf_config,
            "arch": arch,
            "quant_config": quant_config,
            "hf_generation_config": read_generation_config(self.model, self.generation_config),
            "max_logprobs": _resolve_max_logprobs(self.max_logprobs),
            "dtype": resolve_dtype(self.dtype, hf_config),
            "max_model_len": max_model_len,
            "tokenizer": self.tokenizer or self.model,
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    @property
    def architecture(self) -> str:
        return self.arch.architecture

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def num_hidden_layers(self) -> int:
        return self.arch.num_hidden_layers

    @property
    def num_attention_heads(self) -> int:
        return self.arch.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return self.arch.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.arch.head_dim

    def default_sampling_kwargs(self) -> dict[str, Any]:
        """The model's recommended sampling values, as SamplingParams keyword arguments."""
        names = {name: name for name in _GENERATION_DEFAULTS}
        names["max_new_tokens"] = "max_tokens"
        return {
            names[k]: v
            for k, v in self.hf_generation_config.items()
            if k in names and v is not None and self.generation_config != "vllm"
        }

    def eos_token_ids(self) -> list[int]:
        """EOS ids from generation_config.json (as HF `generate` uses), else config.json."""
        ids: Any = self.hf_generation_config.get("eos_token_id")
        if ids is None:
            ids = self.hf_config.get("eos_token_id")
        if ids is None:
            return []
        return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def _resolve_max_logprobs(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise _fail("max_logprobs", f"must be an integer >= -1, got {value!r}")
    return MAX_LOGPROBS if value == -1 else min(value, MAX_LOGPROBS)


def resolve_dtype(dtype: str, hf_config: dict[str, Any]) -> str:
    """ "auto" takes the checkpoint's dtype (float32 when it names none)."""
    if dtype == "auto":
        dtype = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    dtype = dtype.removeprefix("torch.")
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in _DTYPES:
        raise _fail("dtype", f"must be 'auto' or one of {_DTYPES}, got {dtype!r}")
    return dtype


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=_help("tokens per KV cache block"))
    # Block 0 of the pool is reserved as the padding block.
    num_kv_blocks: int | None = field(
        default=None,
        metadata=_help(
            "fix the KV pool size in blocks, of each layer group (default: sized from memory)"
        ),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("reuse KV blocks of shared prompt prefixes")
    )
    # Linear-attention states are reused only where a snapshot was kept: at most one per prefill
    # chunk (its last boundary), whatever the interval. A shorter one leaves a hit fewer tokens to
    # recompute (a 5.8x TTFT hit at 64 tokens on Qwen3.5-35B-A3B, 3.7x at 256).
    recurrent_snapshot_interval: int = field(
        default=64,
        metadata=_help(
            "tokens between the positions where a prefix-cache snapshot of a linear-attention "
            "layer's state may be kept (rounded up to whole blocks, at least 2)"
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_help("fraction of GPU memory the engine may use (weights + KV cache)"),
    )
    # Applies on the CPU always, on the GPU when set.
    kv_cache_memory_bytes: int | None = field(
        default=None,
        metadata=_help(
            "KV pool budget in bytes (default on CPU: what max_num_seqs sequences of "
            "max_model_len need, at most 512 MiB, at least one sequence)"
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help(
            "auto (the model's dtype) or fp8 / fp8_e4m3: KV stored in float8_e4m3 with "
            "per-tensor scales of 1.0 (values saturate at +-448), twice the tokens per byte",
            choices=KV_CACHE_DTYPES,
        ),
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _fail(
                "kv_cache_dtype",
                f"must be one of {KV_CACHE_DTYPES} (fp8_e5m2 and calibrated scales are not "
                f"supported), got {self.kv_cache_dtype!r}",
            )
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size > 1024:
            raise _fail("block_size", f"must be an integer in [1, 1024], got {self.block_size!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2
        ):
            raise _fail("num_kv_blocks", f"must be an integer >= 2, got {self.num_kv_blocks!r}")
        if (
            not isinstance(self.recurrent_snapshot_interval, int)
            or self.recurrent_snapshot_interval < 1
        ):
            raise _fail(
                "recurrent_snapshot_interval",
                f"must be an integer >= 1, got {self.recurrent_snapshot_interval!r}",
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise _fail(
                "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise _fail(
                "kv_cache_memory_bytes", f"must be positive, got {self.kv_cache_memory_bytes!r}"
            )


def snapshot_interval_blocks(cache_config: CacheConfig) -> int:
    """Blocks between the recurrent-state snapshots of the prefix cache (at least 2)."""
    return max(2, -(-cache_config.recurrent_snapshot_interval // cache_config.block_size))


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = field(default=256, metadata=_help("most sequences in one step"))
    max_num_batched_tokens: int = field(
        default=8192, metadata=_help("token budget of one step (prompt chunks + decodes)")
    )
    # Step N+1's tokens reach the host one step later than without it.
    async_scheduling: bool = field(
        default=False,
        metadata=_help(
            "schedule the next step while the device runs the current one (default: on with CUDA)"
        ),
    )

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise _fail("max_num_seqs", f"must be an integer >= 1, got {self.max_num_seqs!r}")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1:
            raise _fail(
                "max_num_batched_tokens",
                f"must be an integer >= 1, got {self.max_num_batched_tokens!r}",
            )


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig | None = None
    draft_model_config: ModelConfig | None = None  # speculative_config's (built by EngineArgs)
    eagle3_config: Eagle3Config | None = None  # speculative_config's head (built by EngineArgs)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        check_parallel_fits_model(self.parallel_config, self.model_config.arch)
        check_lora_fits(
            self.lora_config, self.model_config.arch, self.device_config.batch_invariant
        )
        spec, model = self.speculative_config, self.model_config
        check_speculation_fits(spec, self.parallel_config.pipeline_parallel_size, model.arch)
        if self.device_config.batch_invariant and self.model_config.arch.linear_attention_layers:
            raise _fail(
                "batch_invariant",
                f"not supported for {self.model_config.architecture}: its linear-attention "
                "layers compute a prompt chunk and a decode with different algorithms",
            )
        device = self.device_config
        if (
            device.kernel_backend == "triton"
            and not device.device.startswith("cuda")
            and self.model_config.dtype == "bfloat16"
        ):
            raise _fail(
                "dtype",
                "bfloat16 does not run in Triton's CPU interpreter (kernel_backend 'triton' on "
                "the CPU): use dtype float32 or float16, or kernel_backend 'torch'",
            )
