"""Builds the model for a ModelConfig on a device and fills its weights (checkpoint or dummy)."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ferrum.config import ModelConfig
from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.gguf.reader import is_gguf_path
from ferrum.gguf.weights import GGUFCheckpoint
from ferrum.model_executor.kernel_backend import load_kernels
from ferrum.model_executor.models.registry import get_model_class
from ferrum.model_executor.pipeline_stage import PipelineStage
from ferrum.model_executor.weight_loader import SafetensorsCheckpoint, WeightFileError

DUMMY_STD = 0.02
_MAX_LISTED = 8


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters are created directly in the target dtype; the previous default is restored."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    kernel_backend: str = "torch",
    tp_group: TensorParallelGroup | None = None,
    enable_expert_parallel: bool = False,
    pipeline_stage: PipelineStage | None = None,
    batch_invariant: bool = False,
) -> nn.Module:
    """The model of `model_config.architecture` on `device` in `model_config.dtype`, built with
    the (resolved) kernel backend, weights from the checkpoint's safetensors ("auto",
    "safetensors") or random ("dummy"). With a tensor-parallel group, this rank's shard, reading
    only its part of each checkpoint tensor (dummy weights: each rank draws its own shard from the
    seed). With a pipeline stage, that stage's layers only. `batch_invariant`: the kernels'
    batch-invariant forms."""
    model_class = get_model_class(model_config.architecture)
    kernels = load_kernels(kernel_backend, batch_invariant)
    device = torch.device(device)
    with default_dtype(getattr(torch, model_config.dtype)), torch.device(device):
        model = model_class(
            model_config.arch,
            kernels,
            tp_group=tp_group,
            enable_expert_parallel=enable_expert_parallel,
            quant_config=model_config.quant_config,
            pipeline_stage=pipeline_stage,
        )
    if model_config.load_format == "dummy":
        split = (tp_group is not None and tp_group.world_size > 1) or (
            pipeline_stage is not None and pipeline_stage.size > 1
        )
        initialize_dummy_weights(model, model_config.seed, seed_per_parameter=split)
    else:
        load_checkpoint_weights(model, model_config.model)
    with torch.no_grad():
        for module in model.modules():
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
    return model.eval()


def initialize_dummy_weights(model: nn.Module, seed: int, seed_per_parameter: bool = False) -> None:
    """In place, on the parameters' device, deterministic from `seed`: normal(0, DUMMY_STD) for
    matrices and stacked experts, ones for norm weights, zeros for biases. `seed_per_parameter` (a
    tensor-parallel rank's shard) seeds each matrix's generator from `seed` and the parameter name,
    so parameters every rank holds whole (the MoE router) match across ranks. Quantized layers
    quantize normal(0, DUMMY_STD) values into their own format."""
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device).manual_seed(seed)
        return generators[device]

    with torch.no_grad():
        for name, param in model.named_parameters():
            if getattr(param, "dummy_by_layer", False):
                continue
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            elif seed_per_parameter:
                own = torch.Generator(param.device)
                own.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                param.normal_(0.0, DUMMY_STD, generator=own)
            else:
                param.normal_(0.0, DUMMY_STD, generator=generator(param.device))
        for module in model.modules():
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.fill_dummy_weights(module, DUMMY_STD, generator)


def load_checkpoint_weights(model: nn.Module, model_dir: str) -> None:
    """Streams the folder's safetensors (or a GGUF file's tensors, dequantized) into the model
    and checks every parameter was filled."""
    checkpoint: SafetensorsCheckpoint | GGUFCheckpoint
    if is_gguf_path(model_dir):
        checkpoint = GGUFCheckpoint(model_dir)
    else:
        checkpoint = SafetensorsCheckpoint(model_dir)
    try:
        with torch.no_grad():
            loaded = model.load_weights(checkpoint)
    except WeightFileError:
        raise
    except ValueError as e:
        if checkpoint.current_file is None:
            raise
        raise ValueError(f"{e} (weight file {checkpoint.current_file})") from e
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if missing:
        listed = ", ".join(missing[:_MAX_LISTED])
        more = f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
        raise ValueError(
            f"checkpoint {model_dir} does not provide (all shards of) parameters: {listed}{more}"
        )
