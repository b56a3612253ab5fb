"""The architecture facts of a Hugging Face config.json, parsed once into typed fields.

Models read `ModelArchConfig`, never the raw dict. A missing or unreadable field is a ValueError
naming the field and the architecture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_REQUIRED: Any = object()
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# The architectures (config.json `architectures[0]`) the model registry can build.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


def check_architecture(hf_config: dict[str, Any]) -> str:
    """The config's architecture, or a ValueError naming it and what is supported."""
    architectures = hf_config.get("architectures")
    supported = f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    if not isinstance(architectures, list) or not architectures:
        raise ValueError(f"architectures: config.json names none ({supported})")
    arch = str(architectures[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        nested = (
            " (a multimodal config with a nested text_config: only text-only checkpoints load)"
            if "text_config" in hf_config
            else ""
        )
        raise ValueError(f"architecture {arch!r} is not supported{nested}; {supported}")
    return arch


def rope_parameters(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either config spelling: transformers 5 `rope_parameters` or the
    older top-level `rope_theta` + `rope_scaling`. scaling is None for plain RoPE."""
    params = dict(hf_config.get("rope_parameters") or {})
    legacy = hf_config.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type: {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    scaling.setdefault("original_max_position_embeddings", hf_config.get("max_position_embeddings"))
    return float(theta), scaling


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    hidden_act: str
    rope_theta: float
    # None for plain RoPE; else the scaling parameters, `rope_type` included.
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    # Mixture of experts: num_experts is 0 for dense models (the other MoE fields are then unused).
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelArchConfig:
        arch = check_architecture(hf)

        def get(key: str, kind: Callable[[Any], T], default: Any = _REQUIRED) -> T:
            value = hf.get(key)
            if value is None:
                if default is _REQUIRED:
                    raise ValueError(f"{key}: missing from config.json ({arch})")
                return default
            try:
                return kind(value)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"{key}: unreadable value {value!r} in config.json ({arch})"
                ) from e

        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported")
        num_heads = get("num_attention_heads", int)
        hidden_size = get("hidden_size", int)
        num_experts = get("num_experts", int, None)
        if num_experts is None:  # transformers 5 may write num_local_experts
            num_experts = get("num_local_experts", int, 0)
        moe_default = _REQUIRED if num_experts > 0 else 0
        decoder_sparse_step = get("decoder_sparse_step", int, 1)
        if decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step: must be >= 1, got {decoder_sparse_step}")
        rope_theta, rope_scaling = rope_parameters(hf)
        return cls(
            architecture=arch,
            vocab_size=get("vocab_size", int),
            hidden_size=hidden_size,
            intermediate_size=get("intermediate_size", int),
            num_hidden_layers=get("num_hidden_layers", int),
            num_attention_heads=num_heads,
            num_kv_heads=get("num_key_value_heads", int, 0) or num_heads,
            head_dim=get("head_dim", int, 0) or hidden_size // num_heads,
            max_position_embeddings=get("max_position_embeddings", int, 0) or 2048,
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            hidden_act=get("hidden_act", str, "silu"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=get("tie_word_embeddings", bool, False),
            attention_bias=get("attention_bias", bool, False),
            mlp_bias=get("mlp_bias", bool, False),
            num_experts=num_experts,
            num_experts_per_tok=get("num_experts_per_tok", int, moe_default),
            moe_intermediate_size=get("moe_intermediate_size", int, moe_default),
            norm_topk_prob=get("norm_topk_prob", bool, False),
            decoder_sparse_step=decoder_sparse_step,
            mlp_only_layers=tuple(get("mlp_only_layers", list, [])),
        )
