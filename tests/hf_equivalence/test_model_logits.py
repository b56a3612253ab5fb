"""Model forwards against Hugging Face transformers on tiny random fp32 checkpoints: logits of
prefill, decode and chunked prefill over a paged KV cache equal HF's full-sequence forward."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ferrum.config import ModelConfig
from ferrum.model_arch import rope_parameters
from tests.utils.model_step import Seq, load, prompt, run_step
from tests.utils.tiny_checkpoints import hf_logits, load_hf_model

ATOL = 1e-4

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
    pytest.param("mistral", {}, id="mistral"),
    pytest.param("mistral_sw", {}, id="mistral-sliding"),
    pytest.param("gemma3", {}, id="gemma3"),
    pytest.param("gemma3", {"final_logit_softcapping": 3.0}, id="gemma3-softcap"),
    pytest.param("gemma3_mm", {}, id="gemma3-multimodal"),
]


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
    assert rope_parameters(config) == rope_parameters(ModelConfig(path).hf_config)

    _, model = load(str(legacy))
    tokens = prompt(40, 5)  # beyond original_max_position_embeddings=32, where scaling matters
    logits = run_step(model, [Seq(tokens, list(range(1, 11)), 40)])[0]
    torch.testing.assert_close(logits, hf_logits(path, tokens), atol=ATOL, rtol=0)
