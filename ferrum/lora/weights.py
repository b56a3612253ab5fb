"""An adapter's weights in host memory, unsharded: per (decoder layer, ferrum module) the A and B
matrices of each shard (q/k/v, gate/up, or the whole module), B already multiplied by the
adapter's scaling (so a layer computes y += (x A^T) B^T). Loaded from a validated `AdapterSpec`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from ferrum.errors import FieldError
from ferrum.lora_checkpoint import AdapterSpec

# (decoder layer index, module under the layer such as "self_attn.qkv_proj").
ModuleKey = tuple[int, str]


@dataclass(slots=True)
class LoRAWeights:
    lora_int_id: int
    rank: int
    # module -> shard (None for an unmerged module) -> (A [rank, in], scaling * B [out, rank]).
    modules: dict[ModuleKey, dict[str | None, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )


def load_lora_weights(lora_int_id: int, spec: AdapterSpec, dtype: torch.dtype) -> LoRAWeights:
    """Reads every tensor of `spec` to host memory in `dtype` (scaling folded into B, in fp32
    before the cast)."""
    parts: dict[tuple[ModuleKey, str | None], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(spec.weights_file, framework="pt", device="cpu") as f:
            for t in spec.tensors:
                tensor = f.get_tensor(t.key).float()
                if t.part == "B":
                    tensor = tensor * spec.scaling
                parts.setdefault(((t.layer, t.module), t.shard), {})[t.part] = tensor.to(dtype)
    except (OSError, ValueError, RuntimeError) as e:
        raise FieldError(
            "lora_request", f"LoRA adapter {spec.weights_file}: unreadable ({e})"
        ) from e
    weights = LoRAWeights(lora_int_id, spec.rank)
    for (module, shard), ab in parts.items():
        weights.modules.setdefault(module, {})[shard] = (ab["A"].contiguous(), ab["B"].contiguous())
    return weights
