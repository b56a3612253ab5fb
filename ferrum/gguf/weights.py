"""A GGUF file's tensors as (Hugging Face name, torch tensor) pairs, dequantized while loading.

Supported tensor types are the float ones and Q8_0 / Q4_K / Q5_K / Q6_K (what Q4_K_M, Q4_K_S,
Q5_K_M, Q6_K and Q8_0 files hold); each tensor is dequantized to float32 with
`gguf.quants.dequantize` when it is read, one at a time, and the model copies it into its dtype.
llama.cpp's converter reorders the rows of Llama's Q and K projections (each head's rotary
halves interleaved); they are put back here. Qwen2/3 files keep Hugging Face's order.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from ferrum.gguf.config import gguf_architecture
from ferrum.gguf.reader import import_gguf, open_gguf
from ferrum.gguf.rope import ROPE_FREQS

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Stacked experts [E, out, in] -> one tensor per expert.
_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(name: str) -> str:
    """The Hugging Face name of a (non-expert) GGUF tensor, or a ValueError naming it."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.match(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"tensor {name!r} is not one ferrum knows how to load")
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's Llama Q/K row order: within each head, rows (half h, index j) were
    written at position 2j + h; they return to h * head_dim / 2 + j."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    shaped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return shaped.transpose(1, 2).reshape(weight.shape)


class GGUFCheckpoint:
    """Iterates (name, float32 CPU tensor) over a GGUF file's weights, one tensor at a time;
    `current_file` names the file while it is read. Unsupported tensor types are refused, naming
    the tensor and the type, before any tensor is dequantized."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.current_file: str | None = None
        self._file = open_gguf(path)
        self._arch = gguf_architecture(self._file)
        for tensor in self._file.tensors:
            if tensor.tensor_type.name not in SUPPORTED_TYPES:
                raise ValueError(
                    f"GGUF file {path}: tensor {tensor.name!r} has type "
                    f"{tensor.tensor_type.name}, which ferrum does not load; supported: "
                    f"{', '.join(SUPPORTED_TYPES)}"
                )

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.current_file = self.path
        try:
            for tensor in self._file.tensors:
                if tensor.name == ROPE_FREQS:  # read into the config's rope_scaling
                    continue
                yield from self._named_tensors(tensor)
        finally:
            self.current_file = None

    def _named_tensors(self, tensor: object) -> Iterator[tuple[str, torch.Tensor]]:
        name: str = tensor.name  # type: ignore[attr-defined]
        values = self._dequantize(tensor)
        match = _LAYER_TENSOR.match(name)
        if match is not None and match.group(2) in _EXPERT_NAMES:
            prefix = f"model.layers.{match.group(1)}.mlp.experts"
            projection = _EXPERT_NAMES[match.group(2)]
            for expert, weight in enumerate(values.unbind(0)):
                yield f"{prefix}.{expert}.{projection}.{match.group(3)}", weight
            return
        try:
            target = hf_name(name)
        except ValueError as e:
            raise ValueError(f"GGUF file {self.path}: {e}") from e
        if self._arch == "llama" and target.endswith(("q_proj.weight", "k_proj.weight")):
            key = "head_count" if target.endswith("q_proj.weight") else "head_count_kv"
            values = unpermute_rotary_rows(values, self._file.field(f"llama.attention.{key}", int))
        yield target, values

    def _dequantize(self, tensor: object) -> torch.Tensor:
        """The tensor's values as float32 in torch order (outermost dimension first)."""
        name, kind = tensor.name, tensor.tensor_type  # type: ignore[attr-defined]
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # type: ignore[attr-defined]
        try:
            if kind.name in ("F32", "F16"):
                values = np.array(tensor.data, dtype=np.float32)  # type: ignore[attr-defined]
            else:
                values = import_gguf().quants.dequantize(tensor.data, kind)  # type: ignore[attr-defined]
            return torch.from_numpy(np.ascontiguousarray(values).reshape(shape))
        except (ValueError, TypeError) as e:
            raise ValueError(f"GGUF file {self.path}: cannot read tensor {name!r}: {e}") from e
