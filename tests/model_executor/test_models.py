"""Model definitions against Hugging Face transformers on tiny random fp32 checkpoints.

Each test drives the model through the runner contract by hand: a flat token batch, block tables
and slot mappings over a paged KV cache, then compares logits with HF's full-sequence forward.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import pytest
import torch
from tiny_checkpoints import hf_logits, load_hf_model

from ferrum.config import ModelConfig
from ferrum.model_executor.attention_metadata import AttentionMetadata
from ferrum.model_executor.layers.fused_moe import select_experts
from ferrum.model_executor.layers.rotary import rope_parameters
from ferrum.model_executor.model_loader import load_model
from ferrum.model_executor.models.registry import get_model_class, supported_architectures

BLOCK_SIZE = 4
NUM_BLOCKS = 24
ATOL = 1e-4
CPU = torch.device("cpu")

CASES = [
    pytest.param("llama", {}, id="llama"),
    pytest.param("llama", {"attention_bias": True, "mlp_bias": True}, id="llama-bias"),
    pytest.param("llama3", {}, id="llama3"),
    pytest.param("qwen2", {}, id="qwen2-tied"),
    pytest.param("qwen3", {}, id="qwen3"),
    pytest.param("qwen3_moe", {}, id="qwen3_moe"),
    pytest.param(
        "qwen3_moe",
        {"decoder_sparse_step": 2, "mlp_only_layers": [], "norm_topk_prob": False},
        id="qwen3_moe-step2",
    ),
]


@dataclass
class Seq:
    """One request in a step: its whole context so far, its KV blocks, and how many of the last
    context tokens are this step's query."""

    token_ids: list[int]
    block_ids: list[int]
    num_new: int


def build_step(seqs: list[Seq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    for seq in seqs:
        seq_len = len(seq.token_ids)
        for pos in range(seq_len - seq.num_new, seq_len):
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        query_start_loc.append(len(input_ids))
    max_blocks = max(len(seq.block_ids) for seq in seqs)
    block_tables = [seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq in seqs]
    seq_lens = [len(seq.token_ids) for seq in seqs]
    metadata = AttentionMetadata(
        num_reqs=len(seqs),
        num_tokens=len(input_ids),
        max_query_len=max(seq.num_new for seq in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return torch.tensor(input_ids), torch.tensor(positions), metadata


def new_kv_caches(model_config: ModelConfig) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, model_config.num_kv_heads, model_config.head_dim)
    return [torch.zeros(shape) for _ in range(model_config.num_hidden_layers)]


def load(path: str, **kwargs: object) -> tuple[ModelConfig, torch.nn.Module]:
    config = ModelConfig.from_args(path, **kwargs)
    model = load_model(config, CPU)
    model.bind_kv_caches(new_kv_caches(config))
    return config, model


@torch.inference_mode()
def run_step(model: torch.nn.Module, seqs: list[Seq]) -> list[torch.Tensor]:
    """Logits of each request's query tokens: [num_new, vocab] per request."""
    input_ids, positions, metadata = build_step(seqs)
    logits = model.compute_logits(model(input_ids, positions, metadata))
    assert logits.dtype == torch.float32
    return list(logits.split([seq.num_new for seq in seqs]))


def prompt(length: int, offset: int) -> list[int]:
    return [(offset + 37 * i) % 384 for i in range(length)]


@pytest.mark.parametrize(("arch", "overrides"), CASES)
def test_prefill_then_decode_matches_hf(tiny_checkpoint, arch, overrides) -> None:
    path = tiny_checkpoint(arch, **overrides)
    _, model = load(path)
    hf_model = load_hf_model(path)
    prompts = [prompt(5, 3), prompt(11, 50), prompt(3, 200)]
    # Non-contiguous, interleaved blocks; block 0 is left as padding.
    seqs = [
        Seq(prompts[0], [7, 2], 5),
        Seq(prompts[1], [9, 1, 12, 4], 11),
        Seq(prompts[2], [5, 15], 3),
    ]
    prefill = run_step(model, seqs)
    for seq, logits in zip(seqs, prefill):
        torch.testing.assert_close(logits, hf_logits(hf_model, seq.token_ids), atol=ATOL, rtol=0)

    for seq, logits in zip(seqs, prefill):
        seq.token_ids = seq.token_ids + [int(logits[-1].argmax())]
        seq.num_new = 1
    decode = run_step(model, seqs)
    for seq, logits in zip(seqs, decode):
        expected = hf_logits(hf_model, seq.token_ids)[-1:]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(("arch", "overrides"), CASES)
def test_chunked_prefill_matches_hf(tiny_checkpoint, arch, overrides) -> None:
    path = tiny_checkpoint(arch, **overrides)
    _, model = load(path)
    hf_model = load_hf_model(path)
    long_prompt, short_prompt = prompt(13, 11), prompt(4, 90)
    long_blocks = [3, 11, 6, 20]

    first = run_step(model, [Seq(long_prompt[:6], long_blocks, 6)])[0]
    # Second chunk starts mid-block (position 6 of block 11) and shares the step with a prefill.
    second, other = run_step(model, [Seq(long_prompt, long_blocks, 7), Seq(short_prompt, [8], 4)])
    expected = hf_logits(hf_model, long_prompt)
    torch.testing.assert_close(first, expected[:6], atol=ATOL, rtol=0)
    torch.testing.assert_close(second, expected[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(other, hf_logits(hf_model, short_prompt), atol=ATOL, rtol=0)


def test_legacy_rope_config_keys(tiny_checkpoint, tmp_path) -> None:
    """`rope_theta` + `rope_scaling` (type spelling) load like transformers 5 `rope_parameters`."""
    path = tiny_checkpoint("llama3")
    legacy = shutil.copytree(path, tmp_path / "legacy")
    config_path = os.path.join(legacy, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    with open(config_path, "w") as f:
        json.dump(config, f)
    assert rope_parameters(config) == rope_parameters(ModelConfig.from_args(path).hf_config)

    _, model = load(str(legacy))
    tokens = prompt(40, 5)  # beyond original_max_position_embeddings=32, where scaling matters
    logits = run_step(model, [Seq(tokens, list(range(1, 11)), 40)])[0]
    torch.testing.assert_close(logits, hf_logits(path, tokens), atol=ATOL, rtol=0)


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
        config = ModelConfig.from_args(
            str(config_only), load_format="dummy", seed=seed, dtype=dtype
        )
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
    config = ModelConfig.from_args(str(config_only), load_format="dummy", dtype="bfloat16")
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
        load_model(ModelConfig.from_args(str(folder)), CPU)


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
        load_model(ModelConfig.from_args(str(folder), load_format="dummy"), CPU)
