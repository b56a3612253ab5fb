"""Loading an EAGLE-3 head: its tensors from `*.safetensors` (or the `pytorch_model.bin` most
public heads ship, read with weights_only), checked by name and shape before anything loads: a
missing or misshapen tensor is refused naming `speculative_config.model`, the tensor and the
config field its shape follows from. With load_format "dummy" the head gets random weights of
its config's shapes (benchmarks)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import nn

from ferrum.config_fields import field_error
from ferrum.eagle3_config import Eagle3Config
from ferrum.kernels.interface import Kernels
from ferrum.model_executor.kernel_backend import load_kernels
from ferrum.model_executor.model_loader import default_dtype, initialize_dummy_weights
from ferrum.model_executor.models.llama_eagle3 import Eagle3Head
from ferrum.model_executor.weight_loader import (
    SafetensorsCheckpoint,
    WeightFileError,
    materialize,
)

_FIELD = "speculative_config.model"
HeadT = TypeVar("HeadT", bound=nn.Module)
BIN_FILE = "pytorch_model.bin"


def load_eagle3_head(
    config: Eagle3Config,
    target: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    kernel_backend: str,
    batch_invariant: bool,
    dummy_seed: int | None,
) -> Eagle3Head:
    """The head on `device` in `dtype`; it shares `target`'s embedding unless the checkpoint
    has its own. `dummy_seed`: random weights from it instead of the checkpoint's."""
    tensors = None if dummy_seed is not None else read_head_tensors(config.model)
    own_embedding = tensors is not None and "embed_tokens.weight" in tensors
    hidden = config.arch.hidden_size
    if not own_embedding and hidden != config.target_hidden_size:
        raise field_error(
            _FIELD,
            f"a head of hidden_size {hidden} needs its own embed_tokens.weight (the target's "
            f"embedding is {config.target_hidden_size} wide)",
        )
    if tensors is not None:
        check_head_tensors(config, {name: tuple(t.shape) for name, t in tensors.items()})
    embedding = None if own_embedding else target.model.embed_tokens
    head = build_head(
        lambda kernels: Eagle3Head(config, kernels, embedding), dtype, device, kernel_backend,
        batch_invariant, dummy_seed,
    )  # fmt: skip
    if tensors is None:
        return head
    return load_head_weights(head, tensors.items(), _FIELD, repr(config.model))


def build_head(
    make: Callable[[Kernels], HeadT],
    dtype: torch.dtype,
    device: torch.device,
    kernel_backend: str,
    batch_invariant: bool,
    dummy_seed: int | None,
) -> HeadT:
    """`make(kernels)` on `device` in `dtype`: with `dummy_seed`, random weights from it (in
    eval mode), else parameters still to load (`load_head_weights`)."""
    kernels = load_kernels(kernel_backend, batch_invariant)
    with default_dtype(dtype), torch.device(device):
        head = make(kernels)
    if dummy_seed is not None:
        initialize_dummy_weights(head, dummy_seed)
        head.eval()
    return head


def load_head_weights(
    head: HeadT, tensors: Iterable[tuple[str, torch.Tensor]], field: str, source: str
) -> HeadT:
    """`head` (in eval mode) with `tensors` loaded through its `load_weights`; a tensor it
    cannot take or a parameter left unloaded is refused naming `field` and `source`."""
    with torch.no_grad():
        try:
            loaded = head.load_weights(tensors)
        except (ValueError, RuntimeError) as e:
            raise field_error(field, f"{source}: {e}") from e
    missing = sorted(name for name, _ in head.named_parameters() if name not in loaded)
    if missing:
        raise field_error(field, f"{source} does not provide {missing}")
    return head.eval()


def read_head_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the head's checkpoint by name, read whole (a head is small)."""
    try:
        if os.path.isfile(os.path.join(folder, BIN_FILE)) and not _has_safetensors(folder):
            loaded = torch.load(
                os.path.join(folder, BIN_FILE), map_location="cpu", weights_only=True, mmap=True
            )
            return dict(loaded)
        checkpoint = SafetensorsCheckpoint(folder)
        return {name: materialize(tensor) for name, tensor in checkpoint}
    except (WeightFileError, OSError, RuntimeError) as e:
        raise field_error(_FIELD, f"cannot read the head's weights in {folder!r}: {e}") from e


def _has_safetensors(folder: str) -> bool:
    return any(name.endswith(".safetensors") for name in os.listdir(folder))


def expected_head_shapes(config: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each required tensor's shape and the config fields it follows from."""
    arch = config.arch
    h, heads, kv, d = arch.hidden_size, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim
    inter, layer = arch.intermediate_size, "midlayer"
    shapes = {
        "fc.weight": ((h, len(config.aux_layer_ids) * config.target_hidden_size),
                      "hidden_size, target_hidden_size, eagle_aux_hidden_state_layer_ids"),
        f"{layer}.self_attn.q_proj.weight": ((heads * d, 2 * h), "num_attention_heads"),
        f"{layer}.self_attn.k_proj.weight": ((kv * d, 2 * h), "num_key_value_heads"),
        f"{layer}.self_attn.v_proj.weight": ((kv * d, 2 * h), "num_key_value_heads"),
        f"{layer}.self_attn.o_proj.weight": ((h, heads * d), "num_attention_heads"),
        f"{layer}.mlp.gate_proj.weight": ((inter, h), "intermediate_size"),
        f"{layer}.mlp.up_proj.weight": ((inter, h), "intermediate_size"),
        f"{layer}.mlp.down_proj.weight": ((h, inter), "intermediate_size"),
        "lm_head.weight": ((config.draft_vocab_size, h), "draft_vocab_size"),
    }  # fmt: skip
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        shapes[f"{layer}.{norm}.weight"] = ((h,), "hidden_size")
    shapes["norm.weight"] = ((h,), "hidden_size")
    if config.draft_vocab_size < arch.vocab_size:
        shapes["d2t"] = ((config.draft_vocab_size,), "draft_vocab_size")
    return shapes


def check_head_tensors(config: Eagle3Config, found: dict[str, tuple[int, ...]]) -> None:
    """Refuses a head missing a tensor or holding one of another shape than its config's."""
    expected = expected_head_shapes(config)
    optional = {
        "embed_tokens.weight": ((config.arch.vocab_size, config.arch.hidden_size), "vocab_size"),
        "d2t": ((config.draft_vocab_size,), "draft_vocab_size"),
        "t2d": ((config.arch.vocab_size,), "vocab_size"),
    }
    for name, (shape, fields) in {**optional, **expected}.items():
        if name not in found:
            if name in expected:
                raise field_error(
                    _FIELD, f"{config.model!r} lacks tensor {name!r} of shape {list(shape)}"
                )
            continue
        if tuple(found[name]) != shape:
            raise field_error(
                _FIELD,
                f"{config.model!r}: tensor {name!r} is {list(found[name])}, but its config "
                f"({fields}) makes it {list(shape)}",
            )
