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


GEMMA: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
}
MISTRAL: dict[str, Any] = {"architectures": ["MistralForCausalLM"]}


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
        (GEMMA | {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping: .*not supported"),
        (GEMMA | {"use_bidirectional_attention": True}, "use_bidirectional_attention: "),
        (GEMMA | {"layer_types": ["full_attention"]}, "layer_types: must list 2 of"),
        (MISTRAL | {"sliding_window": 1}, r"sliding_window: must be >= 2, got 1"),
        (
            {"architectures": ["Gemma3ForConditionalGeneration"]},
            "text_config: Gemma3ForConditionalGeneration needs a text_config",
        ),
    ],
)
def test_bad_fields_name_the_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(**changes)


def test_sliding_window_layers() -> None:
    assert parse(sliding_window=8).layer_types == ("full_attention",) * 2  # Llama: unused
    qwen = parse(architectures=["Qwen2ForCausalLM"], sliding_window=8, use_sliding_window=False)
    assert qwen.sliding_window is None and qwen.layer_sliding_window(1) is None
    mistral = parse(**MISTRAL, sliding_window=8)
    assert mistral.layer_types == ("sliding_attention",) * 2
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [8, 8]
    assert parse(**MISTRAL, sliding_window=None).layer_types == ("full_attention",) * 2


def test_gemma3_legacy_and_transformers5_spellings_agree() -> None:
    legacy = parse(
        **GEMMA,
        num_hidden_layers=4,
        sliding_window_pattern=2,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    new = parse(
        **GEMMA,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    )
    assert legacy == new
    assert legacy.layer_types == ("sliding_attention", "full_attention") * 2
    assert [legacy.layer_sliding_window(i) for i in range(4)] == [512, None, 512, None]
    assert (legacy.rope_theta, legacy.rope_scaling["factor"]) == (1e6, 8.0)
    assert (legacy.local_rope_theta, legacy.local_rope_scaling) == (1e4, None)
    assert legacy.hidden_act == "gelu_pytorch_tanh" and legacy.tie_word_embeddings
    assert legacy.query_pre_attn_scalar == 256.0


def test_gemma3_multimodal_reads_its_text_config() -> None:
    text = {k: v for k, v in {**BASE, **GEMMA}.items() if k != "architectures"}
    outer = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": {"hidden_size": 32},
        "tie_word_embeddings": True,
    }
    arch = ModelArchConfig.from_hf_config(outer)
    assert arch.architecture == "Gemma3ForConditionalGeneration"
    assert (arch.hidden_size, arch.sliding_window, arch.tie_word_embeddings) == (64, 512, True)


def test_rope_parameters_spellings_agree() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    legacy = parse(rope_theta=5e5, rope_scaling=scaling)
    new = parse(rope_parameters={"rope_theta": 5e5, **scaling})
    assert (legacy.rope_theta, legacy.rope_scaling) == (new.rope_theta, new.rope_scaling)
    assert rope_parameters({**BASE, "rope_theta": 5e5, "rope_scaling": scaling})[0] == 5e5
    assert legacy.rope_scaling["original_max_position_embeddings"] is None


def test_unsupported_architectures_name_themselves_and_the_supported_ones() -> None:
    # A nested multimodal config: no top-level vocab_size, a text_config.
    nested = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "text_config": {}}
    with pytest.raises(ValueError) as error:
        ModelArchConfig.from_hf_config(nested)
    message = str(error.value)
    assert "'Qwen2_5_VLForConditionalGeneration' is not supported" in message
    assert "text_config" in message and "Qwen3ForCausalLM" in message
    with pytest.raises(ValueError, match="names none .*supported: LlamaForCausalLM"):
        ModelArchConfig.from_hf_config({"vocab_size": 10})


def test_the_registry_builds_exactly_the_supported_architectures() -> None:
    from ferrum.model_arch import SUPPORTED_ARCHITECTURES
    from ferrum.model_executor.models.registry import _MODELS

    assert set(_MODELS) == set(SUPPORTED_ARCHITECTURES)


def test_qwen3_5_layers_partial_rotary_and_router() -> None:
    text = {
        **BASE,
        "num_hidden_layers": 8,
        "full_attention_interval": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
        },
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
    }
    text.pop("intermediate_size", None)
    outer = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text}
    arch = ModelArchConfig.from_hf_config(outer)
    assert arch.linear_attention_layers == (0, 1, 2, 4, 5, 6)
    assert arch.layer_types[3] == arch.layer_types[7] == "full_attention"
    assert (arch.partial_rotary_factor, arch.rope_theta, arch.rope_scaling) == (0.25, 1e7, None)
    assert arch.norm_topk_prob and arch.intermediate_size == 0
    with pytest.raises(ValueError, match="linear_conv_kernel_dim: missing"):
        ModelArchConfig.from_hf_config(
            {
                **outer,
                "text_config": {k: v for k, v in text.items() if k != "linear_conv_kernel_dim"},
            }
        )
