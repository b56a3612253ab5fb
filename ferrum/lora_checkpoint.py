"""Reading a PEFT LoRA folder without torch (the API server validates adapters with it): the
adapter_config.json fields ferrum serves, the safetensors header's tensor names and shapes, each
tensor mapped to ferrum's module (q/k/v into qkv_proj, gate/up into gate_up_proj) and checked
against the base model's shapes. Anything ferrum cannot serve exactly is refused with a
`FieldError("lora_request")` that says what and why: DoRA, biases, modules ferrum lacks, a rank
over max_lora_rank, shapes of another base model, missing or malformed files."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from ferrum.errors import FieldError
from ferrum.model_arch import ModelArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module name -> (ferrum module under a decoder layer, shard of a merged layer or None).
MODULES: dict[str, tuple[str, str | None]] = {
    "q_proj": ("self_attn.qkv_proj", "q"),
    "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate"),
    "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", None),
}
# A multimodal container (Gemma 3's) names its language model's layers language_model.layers.
_KEY = re.compile(
    r"^base_model\.model\.model\.(?:language_model\.)?layers\.(\d+)\.(self_attn|mlp)\."
    r"(\w+)\.lora_([AB])\.weight$"
)
_MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class AdapterTensor:
    """One lora_A ([rank, in]) or lora_B ([out, rank]) tensor of the file."""

    key: str
    layer: int
    module: str
    shard: str | None
    part: str  # "A" or "B"
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A validated adapter: its rank, the scaling of its product (alpha / r, or alpha / sqrt(r)
    with rsLoRA) and its tensors."""

    weights_file: str
    rank: int
    scaling: float
    tensors: tuple[AdapterTensor, ...]


def _refuse(path: str, message: str) -> FieldError:
    return FieldError("lora_request", f"LoRA adapter {path}: {message}")


def module_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each PEFT module name in the base model (unsharded)."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def read_adapter_config(path: str) -> dict[str, Any]:
    """adapter_config.json of a PEFT folder, or a FieldError naming what is wrong."""
    if not os.path.isdir(path):
        raise _refuse(path, "not a folder (a PEFT adapter folder is expected)")
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise _refuse(path, f"{CONFIG_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise _refuse(path, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise _refuse(path, f"{CONFIG_FILE} must hold a JSON object")
    return config


def _scaling(path: str, config: dict[str, Any], max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) from the config, refusing what ferrum does not serve."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(path, f"peft_type {config.get('peft_type')!r}: only LORA is served")
    if config.get("use_dora"):
        raise _refuse(path, "use_dora: DoRA adapters are not supported")
    for name in ("rank_pattern", "alpha_pattern"):
        if config.get(name):
            raise _refuse(path, f"{name}: per-module ranks or alphas are not supported")
    if config.get("bias", "none") != "none":
        raise _refuse(path, f"bias {config['bias']!r}: adapters with biases are not supported")
    if config.get("modules_to_save"):
        raise _refuse(path, f"modules_to_save {config['modules_to_save']}: not supported")
    if config.get("fan_in_fan_out"):
        raise _refuse(path, "fan_in_fan_out: not supported (Conv1D-style base layers)")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _refuse(path, f"r: must be an integer >= 1, got {rank!r}")
    if rank > max_lora_rank:
        raise _refuse(path, f"rank {rank} exceeds max_lora_rank={max_lora_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise _refuse(path, f"lora_alpha: must be a number, got {alpha!r}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(str(t) for t in targets if t not in MODULES)
        if unknown:
            raise _refuse(
                path,
                f"target_modules {unknown}: ferrum has no LoRA for them (it has {list(MODULES)})",
            )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def read_safetensors_header(path: str, file: str) -> dict[str, Any]:
    """The tensor entries (name -> {dtype, shape, data_offsets}) of a safetensors file."""
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise _refuse(path, f"{WEIGHTS_FILE} is not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER_BYTES:
                raise _refuse(path, f"{WEIGHTS_FILE} is not a safetensors file (header size)")
            header = json.loads(f.read(size))
            file_bytes = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise _refuse(path, f"{WEIGHTS_FILE} is missing (adapter_model.bin is not read)") from None
    except (OSError, ValueError) as e:
        raise _refuse(path, f"{WEIGHTS_FILE} is not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise _refuse(path, f"{WEIGHTS_FILE} is not a safetensors file (header)")
    header.pop("__metadata__", None)
    ends = [_data_end(entry) for entry in header.values()]
    if None in ends or 8 + size + max(ends, default=0) > file_bytes:  # type: ignore[operator]
        raise _refuse(path, f"{WEIGHTS_FILE} is truncated or malformed (tensor data offsets)")
    return header


def _data_end(entry: Any) -> int | None:
    """Where a header entry's data ends (None: no valid [start, end] offsets)."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not isinstance(offsets, list) or len(offsets) != 2:
        return None
    start, end = offsets
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in offsets) and 0 <= start <= end
    return end if ok else None


def read_adapter(path: str, arch: ModelArchConfig, max_lora_rank: int) -> AdapterSpec:
    """The validated adapter of a PEFT folder for a base model of `arch`."""
    rank, scaling = _scaling(path, read_adapter_config(path), max_lora_rank)
    weights_file = os.path.join(path, WEIGHTS_FILE)
    header = read_safetensors_header(path, weights_file)
    shapes = module_shapes(arch)
    tensors = []
    for key, entry in sorted(header.items()):
        tensors.append(_adapter_tensor(path, key, entry, arch, shapes, rank))
    if not tensors:
        raise _refuse(path, f"{WEIGHTS_FILE} holds no LoRA tensors")
    pairs: dict[tuple[int, str], set[str]] = {}
    for t in tensors:
        pairs.setdefault((t.layer, t.key.rsplit(".lora_", 1)[0]), set()).add(t.part)
    broken = sorted(name for (_, name), parts in pairs.items() if parts != {"A", "B"})
    if broken:
        raise _refuse(path, f"{broken[0]}: lora_A and lora_B must both be present")
    return AdapterSpec(weights_file, rank, scaling, tuple(tensors))


def _adapter_tensor(
    path: str,
    key: str,
    entry: Any,
    arch: ModelArchConfig,
    shapes: dict[str, tuple[int, int]],
    rank: int,
) -> AdapterTensor:
    """One tensor of the file, checked: a known module, a float dtype, the base model's shape."""
    if "magnitude_vector" in key:
        raise _refuse(path, f"{key}: DoRA adapters are not supported")
    match = _KEY.match(key)
    if match is None:
        raise _refuse(
            path,
            f"tensor {key!r}: ferrum has no LoRA for this module (it serves "
            f"{', '.join(MODULES)} in the decoder layers)",
        )
    layer, block, name, part = int(match[1]), match[2], match[3], match[4]
    if name not in MODULES or not MODULES[name][0].startswith(block):
        raise _refuse(path, f"tensor {key!r}: ferrum has no LoRA for module {block}.{name}")
    if block == "mlp" and arch.num_experts > 0:
        raise _refuse(path, f"tensor {key!r}: LoRA on MoE experts is not supported")
    if layer >= arch.num_hidden_layers:
        raise _refuse(
            path,
            f"tensor {key!r}: layer {layer}, but the base model has {arch.num_hidden_layers} "
            "layers (an adapter of another base model)",
        )
    if not isinstance(entry, dict) or entry.get("dtype") not in ("F32", "F16", "BF16"):
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        raise _refuse(path, f"tensor {key!r}: dtype {dtype!r}, expected F32, F16 or BF16")
    in_features, out_features = shapes[name]
    expected = (rank, in_features) if part == "A" else (out_features, rank)
    shape = tuple(entry["shape"]) if isinstance(entry.get("shape"), list) else ()
    if shape != expected:
        raise _refuse(
            path,
            f"tensor {key!r}: shape {list(shape)}, expected {list(expected)} for this base model "
            f"(rank {rank}; an adapter of another base model?)",
        )
    module, shard = MODULES[name]
    return AdapterTensor(key, layer, module, shard, part, shape)
