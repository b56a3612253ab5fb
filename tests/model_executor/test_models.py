"""Model building on its own: rope and MoE helpers, dummy weights, the architecture registry, KV
cache binding, and configs that must be rejected. (Logits against HF: tests/hf_equivalence.)"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ferrum.config import ModelConfig
from ferrum.kernels.fused_moe_ref import select_experts
from ferrum.model_arch import rope_parameters
from ferrum.model_executor.model_loader import load_model
from ferrum.model_executor.models.registry import get_model_class, supported_architectures
from tests.utils.model_step import CPU, Seq, load, new_kv_caches, prompt, run_step


def test_rope_parameters_spellings_and_errors() -> None:
    assert rope_parameters({}) == (10000.0, None)
    assert rope_parameters({"rope_theta": 5.0e5}) == (5.0e5, None)
    assert rope_parameters({"rope_parameters": {"rope_theta": 7.0, "rope_type": "default"}}) == (
        7.0,
        None,
    )
    theta, scaling = rope_parameters(
        {
            "max_position_embeddings": 64,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
        }
    )
    assert theta == 10000.0 and scaling is not None
    assert scaling["original_max_position_embeddings"] == 64
    with pytest.raises(ValueError, match="rope_type.*'yarn'.*supported"):
        rope_parameters({"rope_scaling": {"type": "yarn", "factor": 4.0}})


def test_select_experts_softmax_topk_renormalize() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 0.0, 2.0]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert ids.tolist() == [[3, 2], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(2))
    assert weights.dtype == torch.float32


def test_dummy_load_is_deterministic_and_reads_no_weights(tiny_checkpoint, tmp_path) -> None:
    source = tiny_checkpoint("qwen2")
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    shutil.copy(os.path.join(source, "config.json"), config_only)

    def dummy(seed: int, dtype: str = "float32") -> torch.nn.Module:
        config = ModelConfig(str(config_only), load_format="dummy", seed=seed, dtype=dtype)
        return load_model(config, CPU)

    first, same, other = dummy(1), dummy(1), dummy(2)
    for (name, p), (_, q), (_, r) in zip(
        first.named_parameters(), same.named_parameters(), other.named_parameters()
    ):
        assert torch.equal(p, q), name
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif p.dim() == 1:
            assert torch.all(p == 1), name
        else:
            assert not torch.equal(p, r), name
            assert 0.015 < p.std().item() < 0.025, name

    bf16 = dummy(1, "bfloat16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.model.rotary_emb.cos_cache.dtype == torch.float32
    config = ModelConfig(str(config_only), load_format="dummy", dtype="bfloat16")
    bf16.bind_kv_caches([c.bfloat16() for c in new_kv_caches(config)])
    logits = run_step(bf16, [Seq(prompt(9, 1), [1, 2, 3], 9)])[0]
    assert torch.isfinite(logits).all()


def test_registry_rejects_unknown_architecture(tiny_checkpoint, tmp_path) -> None:
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel' is not supported; supported: \["):
        get_model_class("GPT2LMHeadModel")
    assert "LlamaForCausalLM" in supported_architectures()

    folder = shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "unknown")
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["architectures"] = ["MysteryForCausalLM"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="MysteryForCausalLM"):
        load_model(ModelConfig(str(folder)), CPU)


def test_kv_cache_binding_errors(tiny_checkpoint) -> None:
    config, model = load(tiny_checkpoint("qwen3"))
    caches = new_kv_caches(config)
    with pytest.raises(ValueError, match="kv_caches: expected one cache per decoder layer"):
        model.bind_kv_caches(caches[:1])
    with pytest.raises(ValueError, match="kv_caches: each layer's cache must be"):
        model.bind_kv_caches([torch.zeros(2, 4, 4, 3, 16) for _ in caches])
    model.bind_kv_caches([])
    with pytest.raises(ValueError, match="no KV cache bound"):
        run_step(model, [Seq(prompt(3, 0), [1], 3)])


@pytest.mark.parametrize(
    ("arch", "edit", "message"),
    [
        ("qwen2", {"use_sliding_window": True}, "use_sliding_window: sliding-window"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act: 'gelu' is not supported"),
        ("qwen3_moe", {"hidden_act": "relu"}, "hidden_act: 'relu' is not supported"),
        ("qwen3", {"intermediate_size": None}, "intermediate_size: missing from config.json"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, r"num_experts_per_tok: must be in \[1, "),
        ("llama", {"num_key_value_heads": 3}, "num_key_value_heads: must divide"),
    ],
)
def test_unsupported_config_is_rejected(tiny_checkpoint, tmp_path, arch, edit, message) -> None:
    folder = shutil.copytree(tiny_checkpoint(arch), tmp_path / "ckpt")
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(edit)
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        load_model(ModelConfig(str(folder), load_format="dummy"), CPU)
