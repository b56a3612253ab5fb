"""config.json -> ModelArchConfig: typed fields, defaults, and errors naming field and model."""

from __future__ import annotations

from typing import Any

import pytest

from ferrum.model_arch import ModelArchConfig, rope_parameters

BASE: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def parse(**changes: Any) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config({**BASE, **changes})


def test_defaults_follow_hf() -> None:
    arch = parse()
    assert (arch.num_kv_heads, arch.head_dim, arch.max_position_embeddings) == (4, 16, 2048)
    assert (arch.rms_norm_eps, arch.hidden_act, arch.rope_theta) == (1e-6, "silu", 10000.0)
    assert arch.rope_scaling is None and not arch.tie_word_embeddings
    assert (arch.num_experts, arch.num_experts_per_tok, arch.mlp_only_layers) == (0, 0, ())
    arch = parse(num_key_value_heads=2, head_dim=32, max_position_embeddings=512)
    assert (arch.num_kv_heads, arch.head_dim, arch.max_position_embeddings) == (2, 32, 512)


def test_moe_fields() -> None:
    arch = parse(
        num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1]
    )
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 32)
    assert arch.mlp_only_layers == (1,)
    with pytest.raises(ValueError, match=r"moe_intermediate_size: missing .*\(LlamaForCausalLM\)"):
        parse(num_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": None}, r"hidden_size: missing from config.json \(LlamaForCausalLM\)"),
        ({"num_hidden_layers": "two"}, r"num_hidden_layers: unreadable value 'two' .*Llama"),
        ({"architectures": []}, "architectures: config.json names none"),
        ({"use_sliding_window": True}, "use_sliding_window: sliding-window attention"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step: must be >= 1"),
    ],
)
def test_bad_fields_name_the_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(**changes)


def test_rope_parameters_spellings_agree() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    legacy = parse(rope_theta=5e5, rope_scaling=scaling)
    new = parse(rope_parameters={"rope_theta": 5e5, **scaling})
    assert (legacy.rope_theta, legacy.rope_scaling) == (new.rope_theta, new.rope_scaling)
    assert rope_parameters({**BASE, "rope_theta": 5e5, "rope_scaling": scaling})[0] == 5e5
    assert legacy.rope_scaling["original_max_position_embeddings"] is None


def test_unsupported_architectures_name_themselves_and_the_supported_ones() -> None:
    # A nested multimodal config (Qwen3.5's shape): no top-level vocab_size, a text_config.
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {}}
    with pytest.raises(ValueError) as error:
        ModelArchConfig.from_hf_config(nested)
    message = str(error.value)
    assert "'Qwen3_5ForConditionalGeneration' is not supported" in message
    assert "text_config" in message and "Qwen3ForCausalLM" in message
    with pytest.raises(ValueError, match="names none .*supported: LlamaForCausalLM"):
        ModelArchConfig.from_hf_config({"vocab_size": 10})


def test_the_registry_builds_exactly_the_supported_architectures() -> None:
    from ferrum.model_arch import SUPPORTED_ARCHITECTURES
    from ferrum.model_executor.models.registry import _MODELS

    assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES)
