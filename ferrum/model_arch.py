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
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# The architectures (config.json `architectures[0]`) the model registry can build.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)
# Multimodal containers of which only the language model (config.json `text_config`) loads.
TEXT_CONFIG_ARCHITECTURES = (
    "Gemma3ForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
# Gated DeltaNet (Qwen3.5): a recurrent state per request instead of a KV cache.
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)


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


def rope_parameters(
    hf_config: dict[str, Any], layer_type: str = FULL_ATTENTION
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from either config spelling: transformers 5 `rope_parameters` (flat,
    or one entry per layer type as Gemma 3 writes it) or the older top-level `rope_theta` +
    `rope_scaling` (+ Gemma 3's `rope_local_base_freq` for sliding layers). scaling is None for
    plain RoPE."""
    params = dict(hf_config.get("rope_parameters") or {})
    per_type = any(key in params for key in LAYER_TYPES)
    if per_type:
        params = dict(params.get(layer_type) or {})
    local_theta = hf_config.get("rope_local_base_freq")
    if layer_type == SLIDING_ATTENTION and local_theta is not None and not per_type:
        # Legacy Gemma 3: sliding layers use plain RoPE at their own base.
        return float(local_theta), None
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


def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: the nested `text_config` of a multimodal container (its
    top-level `architectures` kept), else the config itself."""
    if check_architecture(hf_config) not in TEXT_CONFIG_ARCHITECTURES:
        return hf_config
    nested = hf_config.get("text_config")
    if not isinstance(nested, dict):
        raise ValueError(
            f"text_config: {hf_config['architectures'][0]} needs a text_config object in "
            "config.json"
        )
    inherited = {k: hf_config[k] for k in ("tie_word_embeddings",) if k in hf_config}
    return {**inherited, **nested, "architectures": hf_config["architectures"]}


def _layer_types(hf: dict[str, Any], arch: str, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention: Gemma 3 lists them (or gives a pattern: every n-th layer is
    global); Qwen3.5 lists them (or every `full_attention_interval`-th layer is full attention,
    the others linear); Mistral slides in every layer when it sets `sliding_window` (Qwen's
    `sliding_window` without `use_sliding_window` is unused)."""
    if arch.startswith("Qwen3_5"):
        layer_types = hf.get("layer_types")
        if layer_types is None:
            interval = int(hf.get("full_attention_interval") or 4)
            layer_types = [
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                for i in range(num_layers)
            ]
    elif arch.startswith("Gemma3"):
        layer_types = hf.get("layer_types")
        if layer_types is None:
            pattern = int(hf.get("sliding_window_pattern") or 6)
            layer_types = [
                SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                for i in range(num_layers)
            ]
    elif arch == "MistralForCausalLM" and hf.get("sliding_window") is not None:
        layer_types = [SLIDING_ATTENTION] * num_layers
    else:
        layer_types = [FULL_ATTENTION] * num_layers
    allowed = LAYER_TYPES if arch.startswith("Qwen3_5") else LAYER_TYPES[:2]
    if len(layer_types) != num_layers or any(t not in allowed for t in layer_types):
        raise ValueError(
            f"layer_types: must list {num_layers} of {list(allowed)} ({arch}), got {layer_types!r}"
        )
    return tuple(layer_types)


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
    # Attention of each layer (FULL_ATTENTION or SLIDING_ATTENTION); sliding layers see their
    # last `sliding_window` positions (p - W < k <= p) and rotate with the local RoPE.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    local_rope_theta: float = 10000.0
    local_rope_scaling: dict[str, Any] | None = None
    # Attention scale is query_pre_attn_scalar ** -0.5 when set (Gemma), else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # logits = cap * tanh(logits / cap) when set.
    final_logit_softcapping: float | None = None
    # Full attention rotates the first head_dim * partial_rotary_factor dims of each head.
    partial_rotary_factor: float = 1.0
    # Gated DeltaNet (LINEAR_ATTENTION layers): heads, head sizes and causal conv width.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # A shared expert beside the routed ones (Qwen3.5-MoE), 0 for none.
    shared_expert_intermediate_size: int = 0
    # Multi-token-prediction layers of the checkpoint (`mtp.*`, Qwen3.5), 0 for none.
    mtp_num_hidden_layers: int = 0

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Indices of the LINEAR_ATTENTION layers (they keep a recurrent state, no KV cache)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of layer `layer_idx`'s attention, None for full attention."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelArchConfig:
        arch = check_architecture(hf)
        hf = text_config(hf)

        get = _config_reader(hf, arch)
        _refuse_unsupported(hf, arch)
        num_layers = get("num_hidden_layers", int)
        layer_types = _layer_types(hf, arch, num_layers)
        sliding_window = (
            get("sliding_window", int, None) if SLIDING_ATTENTION in layer_types else None
        )
        # A window of 1 (each token sees only itself) releases a block before it is cached.
        if sliding_window is not None and sliding_window < 2:
            raise ValueError(f"sliding_window: must be >= 2, got {sliding_window} ({arch})")
        local_rope_theta, local_rope_scaling = rope_parameters(hf, SLIDING_ATTENTION)
        hidden_act = get("hidden_act", str, None) or get("hidden_activation", str, "silu")
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
        partial_rotary = (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
        partial_rotary = float(partial_rotary or hf.get("partial_rotary_factor") or 1.0)
        has_linear = LINEAR_ATTENTION in layer_types
        linear_default = _REQUIRED if has_linear else 0
        qwen3_5 = arch.startswith("Qwen3_5")
        return cls(
            architecture=arch,
            vocab_size=get("vocab_size", int),
            hidden_size=hidden_size,
            # MoE models without dense layers (Qwen3.5-MoE) may leave it out.
            intermediate_size=get("intermediate_size", int, 0 if num_experts > 0 else _REQUIRED),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_kv_heads=get("num_key_value_heads", int, 0) or num_heads,
            head_dim=get("head_dim", int, 0) or hidden_size // num_heads,
            max_position_embeddings=get("max_position_embeddings", int, 0) or 2048,
            rms_norm_eps=get("rms_norm_eps", float, 1e-6),
            hidden_act=hidden_act,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # Gemma ties them unless told otherwise (its checkpoints carry no lm_head).
            tie_word_embeddings=get("tie_word_embeddings", bool, arch.startswith("Gemma3")),
            attention_bias=get("attention_bias", bool, False),
            mlp_bias=get("mlp_bias", bool, False),
            num_experts=num_experts,
            num_experts_per_tok=get("num_experts_per_tok", int, moe_default),
            moe_intermediate_size=get("moe_intermediate_size", int, moe_default),
            # Qwen3.5-MoE's router always renormalizes its top-k (its config has no flag).
            norm_topk_prob=get("norm_topk_prob", bool, qwen3_5),
            decoder_sparse_step=decoder_sparse_step,
            mlp_only_layers=tuple(get("mlp_only_layers", list, [])),
            layer_types=layer_types,
            sliding_window=sliding_window,
            local_rope_theta=local_rope_theta,
            local_rope_scaling=local_rope_scaling,
            query_pre_attn_scalar=get("query_pre_attn_scalar", float, None),
            final_logit_softcapping=get("final_logit_softcapping", float, None),
            partial_rotary_factor=partial_rotary,
            linear_num_key_heads=get("linear_num_key_heads", int, linear_default),
            linear_num_value_heads=get("linear_num_value_heads", int, linear_default),
            linear_key_head_dim=get("linear_key_head_dim", int, linear_default),
            linear_value_head_dim=get("linear_value_head_dim", int, linear_default),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim", int, linear_default),
            shared_expert_intermediate_size=get("shared_expert_intermediate_size", int, 0),
            mtp_num_hidden_layers=get("mtp_num_hidden_layers", int, 0),
        )


def _config_reader(hf: dict[str, Any], arch: str) -> Callable[..., Any]:
    """`get(key, kind, default)`: config.json's `key` as `kind`; missing (or null), `default`,
    unless there is none; an unreadable value names the key."""

    def get(key: str, kind: Callable[[Any], T], default: Any = _REQUIRED) -> T:
        value = hf.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ValueError(f"{key}: missing from config.json ({arch})")
            return default
        try:
            return kind(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{key}: unreadable value {value!r} in config.json ({arch})") from e

    return get


def _refuse_unsupported(hf: dict[str, Any], arch: str) -> None:
    if hf.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window: sliding-window attention is not supported ({arch})")
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"attn_logit_softcapping: attention soft-capping is not supported ({arch})"
        )
    if hf.get("use_bidirectional_attention"):
        raise ValueError(
            f"use_bidirectional_attention: only causal attention is supported ({arch})"
        )
