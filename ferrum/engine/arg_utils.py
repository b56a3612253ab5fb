"""EngineArgs: the user-facing engine knobs, shared by `LLM(...)` and every CLI command. Each field
is an `LLM` keyword and a kebab-case flag (booleans also get `--no-...`), with the default, help
and choices of the config field of the same name; `device` and `async_scheduling` default to None
(picked from the hardware). `structured_outputs_config`: a config, a dict of its fields, or JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from ferrum.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from ferrum.default_model import resolve_model
from ferrum.engine.draft_model_config import draft_model_config, eagle3_config
from ferrum.engine.vllm_args import VLLM_ARG_HELP, resolve_vllm_args
from ferrum.logger import init_logger
from ferrum.lora_config import LoRAConfig
from ferrum.speculative_config import SpeculativeConfig

logger = init_logger(__name__)

# vLLM engine arguments ferrum does not have -> the value that means "off" in vLLM (accepted: it
# asks for what ferrum does); any other value raises a ValueError naming the argument.
NOT_SUPPORTED_YET: dict[str, Any] = {
    "fully_sharded_loras": False,
    "lora_dtype": "auto",
    "revision": None,
    "download_dir": None,
    "hf_token": None,
    "limit_mm_per_prompt": None,
    "mm_processor_kwargs": None,
    "rope_scaling": None,
    "compilation_config": None,
}


def check_not_supported_yet(kwargs: dict[str, Any]) -> None:
    """Raises a clear error for arguments ferrum does not know: "not supported yet" (ValueError)
    for vLLM's engine arguments set to anything but their "off" value, TypeError otherwise."""
    for name, value in kwargs.items():
        if name not in NOT_SUPPORTED_YET:
            known = ", ".join(f.name for f in fields(EngineArgs))
            raise TypeError(f"unexpected engine argument {name!r}; ferrum's are: {known}")
        if value != NOT_SUPPORTED_YET[name]:
            raise ValueError(
                f"{name}={value!r}: not supported yet by ferrum (only "
                f"{NOT_SUPPORTED_YET[name]!r}); see the README's 'Not supported yet' list"
            )


_Config = TypeVar("_Config")

# vLLM's short forms of some flags.
_SHORT_FLAGS = {
    "tensor_parallel_size": ("-tp",),
    "pipeline_parallel_size": ("-pp",),
    "data_parallel_size": ("-dp",),
    "optimization_level": ("-O",),
}

_CONFIG_FIELDS = {
    f.name: f
    for config_class in (
        ModelConfig,
        CacheConfig,
        SchedulerConfig,
        DeviceConfig,
        ParallelConfig,
        LoRAConfig,
    )
    for f in fields(config_class)
    if "help" in f.metadata
}


# Fields given on the command line as JSON, and their help.
_JSON_FLAGS = {
    "structured_outputs_config": "grammar compilation for structured outputs, as JSON: "
    '{"compile_timeout_s": 10.0, "compile_cache_size": 256, "compile_max_workers": 4, '
    '"disable_any_whitespace": true} (the defaults)',
    "speculative_config": "speculative decoding, as JSON (vLLM's keys): "
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 1, "disable_by_batch_size": 16}',
}


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = ModelConfig.tokenizer
    dtype: str = ModelConfig.dtype
    device: str | None = None
    load_format: str = ModelConfig.load_format
    skip_tokenizer_init: bool = ModelConfig.skip_tokenizer_init
    max_model_len: int | None = ModelConfig.max_model_len
    block_size: int = CacheConfig.block_size
    num_kv_blocks: int | None = CacheConfig.num_kv_blocks
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    recurrent_snapshot_interval: int = CacheConfig.recurrent_snapshot_interval
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    seed: int = ModelConfig.seed
    max_logprobs: int = ModelConfig.max_logprobs
    generation_config: str = ModelConfig.generation_config
    quantization: str | None = ModelConfig.quantization
    kernel_backend: str = DeviceConfig.kernel_backend
    enforce_eager: bool = DeviceConfig.enforce_eager
    batch_invariant: bool = DeviceConfig.batch_invariant
    num_cpu_threads: int | None = DeviceConfig.num_cpu_threads
    tuned_config_dir: str | None = DeviceConfig.tuned_config_dir
    attention_backend: str = DeviceConfig.attention_backend
    async_scheduling: bool | None = None
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size
    enable_expert_parallel: bool = ParallelConfig.enable_expert_parallel
    data_parallel_size: int = ParallelConfig.data_parallel_size
    distributed_executor_backend: str | None = ParallelConfig.distributed_executor_backend
    disable_custom_all_reduce: bool = ParallelConfig.disable_custom_all_reduce
    worker_step_timeout: float = ParallelConfig.worker_step_timeout
    enable_lora: bool = LoRAConfig.enable_lora
    max_loras: int = LoRAConfig.max_loras
    max_lora_rank: int = LoRAConfig.max_lora_rank
    max_cpu_loras: int | None = LoRAConfig.max_cpu_loras
    structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | None = None
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    # vLLM's arguments without a config field: accepted, mapped or refused (vllm_args.py).
    enable_chunked_prefill: bool | None = None
    cpu_offload_gb: float | None = None
    swap_space: float | None = None
    trust_remote_code: bool | None = None
    disable_log_stats: bool = False
    tokenizer_mode: str = "auto"
    max_seq_len_to_capture: int | None = None
    optimization_level: int | None = None

    def create_engine_config(self) -> EngineConfig:
        """Resolves the model (None or the shipped model's name: its folder), device None (cuda
        when available), async_scheduling None (on with CUDA) and dtype "auto" (float32 where
        bfloat16 cannot run: Triton's CPU interpreter), then builds the validated configs."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values |= resolve_vllm_args(values, logger)
        device = self.device or _default_device()
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            data_parallel_size=self.data_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            disable_custom_all_reduce=self.disable_custom_all_reduce,
            worker_step_timeout=self.worker_step_timeout,
        )
        _check_device_exists(device, parallel_config)
        speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            async_scheduling = device.startswith("cuda")
        values |= {
            "model": resolve_model(self.model),
            "device": device,
            "async_scheduling": async_scheduling,
        }
        model_config = ModelConfig(**_init_args(ModelConfig, values))
        if (
            self.dtype == "auto"
            and model_config.dtype == "bfloat16"
            and _runs_triton_interpreter(device, self.kernel_backend)
        ):
            logger.info("dtype auto: float32, since Triton's CPU interpreter has no bfloat16")
            model_config = ModelConfig(**_init_args(ModelConfig, values | {"dtype": "float32"}))
        values["max_model_len"] = model_config.max_model_len
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(**_init_args(CacheConfig, values)),
            scheduler_config=SchedulerConfig(**_init_args(SchedulerConfig, values)),
            device_config=DeviceConfig(**_init_args(DeviceConfig, values)),
            parallel_config=parallel_config,
            structured_outputs_config=_structured_outputs_config(self.structured_outputs_config),
            speculative_config=speculative_config,
            draft_model_config=draft_model_config(speculative_config, model_config),
            eagle3_config=eagle3_config(speculative_config, model_config.arch),
            lora_config=LoRAConfig(**_init_args(LoRAConfig, values)),
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
        """Adds one flag per field; the model is a positional argument (optional) unless told."""
        for f in fields(EngineArgs):
            if f.name in _JSON_FLAGS:
                flag = "--" + f.name.replace("_", "-")
                parser.add_argument(
                    flag, dest=f.name, type=json.loads, default=None, help=_JSON_FLAGS[f.name]
                )
                continue
            if f.name in _CONFIG_FIELDS:
                metadata = _CONFIG_FIELDS[f.name].metadata
            else:
                metadata = {"help": "vLLM's; " + VLLM_ARG_HELP[f.name]}
            if f.name == "model":
                name_or_flag = "model" if model_positional else "--model"
                nargs = {"nargs": "?"} if model_positional else {}
                parser.add_argument(name_or_flag, **nargs, default=None, help=metadata["help"])
                continue
            help_text = metadata["help"]
            if f.default is not None and "(default" not in help_text:
                help_text += f" (default: {f.default})"
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": help_text}
            if f.type in ("bool", "bool | None"):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _parse_type(f.type)
            if "choices" in metadata:
                kwargs["choices"] = metadata["choices"]
            flags = ["--" + f.name.replace("_", "-"), *_SHORT_FLAGS.get(f.name, ())]
            parser.add_argument(*flags, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, default_model: str) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["model"] = values.get("model") or default_model
        return cls(**values)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


def add_config_args(parser: argparse.ArgumentParser, config_class: type) -> None:
    """One flag per field of a flat config dataclass, its help and choices from the field's
    metadata (`ferrum serve`'s recovery and HTTP-limit configs)."""
    for f in fields(config_class):
        help_text = f.metadata["help"]
        if f.default not in (None, False, ""):
            help_text += f" (default: {f.default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": help_text}
        if str(f.type) == "bool":
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _parse_type(str(f.type))
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def config_from_args(config_class: type[_Config], args: argparse.Namespace) -> _Config:
    """The config whose fields `add_config_args` turned into flags, from the parsed flags."""
    return config_class(**{f.name: getattr(args, f.name) for f in fields(config_class)})


def _init_args(config_class: type, values: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments of `config_class` taken from `values` by field name."""
    return {f.name: values[f.name] for f in fields(config_class) if f.init}


def _structured_outputs_config(
    value: StructuredOutputsConfig | dict[str, Any] | None,
) -> StructuredOutputsConfig:
    if value is None:
        return StructuredOutputsConfig()
    if isinstance(value, StructuredOutputsConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(
            "structured_outputs_config: must be a StructuredOutputsConfig or a dict of its "
            f"fields, got {value!r}"
        )
    known = {f.name for f in fields(StructuredOutputsConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"structured_outputs_config: unknown field(s) {unknown}; known: {sorted(known)}"
        )
    return StructuredOutputsConfig(**value)


def _parse_type(annotation: str) -> type:
    base = annotation.split("|")[0].strip()
    return {"int": int, "float": float, "str": str}[base]


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _runs_triton_interpreter(device: str, kernel_backend: str) -> bool:
    return kernel_backend == "triton" and not device.startswith("cuda")


def _check_device_exists(device: str, parallel_config: ParallelConfig) -> None:
    """The CUDA devices asked for must exist (else one clear error, before anything loads):
    from the given index, one per rank of every replica. Not with the Ray backend: its ranks run
    on the cluster's GPUs, maybe on other nodes (its placement group checks that they exist)."""
    if not device.startswith("cuda") or parallel_config.distributed_executor_backend == "ray":
        return
    import torch

    if not torch.cuda.is_available():
        build = "has no CUDA support" if torch.version.cuda is None else "finds no CUDA GPU"
        raise ValueError(
            f"device: {device!r} was asked for, but this torch build ({torch.__version__}) "
            f"{build}; use --device cpu (or leave the device unset)"
        )
    index = device.partition(":")[2] or "0"
    if not index.isdigit():
        return
    dp, tp = parallel_config.data_parallel_size, parallel_config.world_size
    last = int(index) + dp * tp - 1
    if last >= torch.cuda.device_count():
        field = "device" if dp * tp == 1 else "data_parallel_size"
        raise ValueError(
            f"{field}: {dp} replica(s) x {tp} rank(s) from {device!r} need cuda:{index} to "
            f"cuda:{last}; {device!r} does not exist or too few follow it "
            f"({torch.cuda.device_count()} CUDA device(s))"
        )
