"""Tiny random Hugging Face checkpoints and an HF greedy oracle, for model and engine tests.

Stable API (engine tests import it; the `tiny_checkpoint` fixture in tests/conftest.py caches
builds per session):

    make_tiny_checkpoint(path, arch, **config_overrides) -> str   # the folder, = str(path)
    hf_greedy(path, prompts, max_new_tokens) -> list[list[int]]   # generated ids per prompt
    hf_logits(path, token_ids) -> Tensor [len(token_ids), vocab]  # float32, HF forward

`arch` is one of ARCHS:
    "llama"      LlamaForCausalLM, GQA (4 heads / 2 kv heads), saved sharded (several files
                 plus model.safetensors.index.json)
    "llama3"     LlamaForCausalLM with llama3 RoPE scaling (small original context so the
                 scaling changes frequencies)
    "qwen2"      Qwen2ForCausalLM (qkv bias), tied word embeddings
    "qwen3"      Qwen3ForCausalLM (q/k norm)
    "qwen3_moe"  Qwen3MoeForCausalLM, 3 layers, 8 experts top-2, norm_topk_prob, layer 1 dense
    "mistral"    MistralForCausalLM without a sliding window
    "mistral_sw" MistralForCausalLM with sliding_window 6 (not a multiple of any block size)
    "gemma3"     Gemma3ForCausalLM, 3 layers: sliding (window 6), global, sliding; linear RoPE
                 scaling on the global layer, query_pre_attn_scalar 12, tied embeddings
    "gemma3_mm"  Gemma3ForConditionalGeneration: the "gemma3" text model inside the multimodal
                 container with a one-layer vision tower
    "qwen3_5"    Qwen3_5ForCausalLM, 4 layers: linear (gated DeltaNet, 2 key / 4 value heads of
                 16, conv width 4), linear, full (gated, partial rotary 0.5), linear
    "qwen3_5_moe" Qwen3_5MoeForCausalLM: "qwen3_5" with 8 experts top-2 and a shared expert
    "qwen3_5_mm" Qwen3_5ForConditionalGeneration: "qwen3_5" inside the multimodal container
Shapes: hidden 64, head_dim 16, vocab 384 (token ids 0..383), max_position_embeddings 256.
Special ids: bos 1, eos 2, pad 0 (config.json and generation_config.json); hf_greedy does not
stop at eos, so engine comparisons should ignore eos. No tokenizer files are written.
All are fp32 and deterministic; `seed` and `max_shard_size` are keyword options, anything else
overrides a config.json key (e.g. tie_word_embeddings=True, num_hidden_layers=3).
Every parameter is drawn from a fixed seed with std 0.15 (norm weights 1 + 0.1 * noise, biases
0.1 * noise), so logits are well separated and greedy decoding is stable.
"""

from __future__ import annotations

import os
from typing import Any

import torch

ARCHS = (
    "llama",
    "llama3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "mistral_sw",
    "gemma3",
    "gemma3_mm",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_mm",
)
# The sliding window of "mistral_sw" and of the sliding layers of "gemma3" / "gemma3_mm".
SLIDING_WINDOW = 6
INIT_STD = 0.15

_COMMON: dict[str, Any] = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 10000.0, "tie_word_embeddings": False},
    "llama3": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        "tie_word_embeddings": False,
    },
    "qwen2": {"rope_theta": 1000000.0, "tie_word_embeddings": True},
    "qwen3": {"rope_theta": 1000000.0, "tie_word_embeddings": False},
    "qwen3_moe": {
        "rope_theta": 1000000.0,
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "tie_word_embeddings": False,
    },
    "mistral": {"rope_theta": 10000.0, "sliding_window": None, "tie_word_embeddings": False},
    "mistral_sw": {"rope_theta": 10000.0, "sliding_window": 6, "tie_word_embeddings": False},
    "gemma3": {
        "num_hidden_layers": 3,
        "sliding_window": 6,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 12,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "tie_word_embeddings": True,
    },
}
_QWEN3_5 = {
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "tie_word_embeddings": False,
}
_ARCH_CONFIGS["qwen3_5"] = _ARCH_CONFIGS["qwen3_5_mm"] = _QWEN3_5
_ARCH_CONFIGS["qwen3_5_moe"] = {
    **_QWEN3_5,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
_ARCH_CONFIGS["gemma3_mm"] = _ARCH_CONFIGS["gemma3"]
# The vision tower of "gemma3_mm": as small as its config allows.
_GEMMA3_VISION = {
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}

# The vision tower of "qwen3_5_mm": as small as its config allows.
_QWEN3_5_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_heads": 2,
    "out_hidden_size": 64,
}

# Default max_shard_size per arch: only "llama" is sharded (its tensors exceed 20 KB one by one).
_DEFAULT_SHARD_SIZE = {"llama": "20KB"}


def _config_class(arch: str) -> Any:
    import transformers

    return {
        "llama": transformers.LlamaConfig,
        "llama3": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mistral": transformers.MistralConfig,
        "mistral_sw": transformers.MistralConfig,
        "gemma3": transformers.Gemma3TextConfig,
        "qwen3_5": transformers.Qwen3_5TextConfig,
        "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig,
    }[arch]


def _make_config(arch: str, kwargs: dict[str, Any]) -> Any:
    import transformers

    if arch == "qwen3_5_mm":
        text = transformers.Qwen3_5TextConfig(**kwargs)
        return transformers.Qwen3_5Config(text_config=text.to_dict(), vision_config=_QWEN3_5_VISION)
    if arch != "gemma3_mm":
        return _config_class(arch)(**kwargs)
    text = transformers.Gemma3TextConfig(**kwargs)
    return transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=_GEMMA3_VISION, mm_tokens_per_image=4
    )


def _randomize(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("bias"):
                param.copy_(0.1 * noise)
            elif param.dim() == 1:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(INIT_STD * noise)


def make_tiny_checkpoint(
    path: str | os.PathLike[str],
    arch: str,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> str:
    """Writes config.json + fp32 safetensors of a random tiny `arch` model into `path`."""
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch: {arch!r} is not one of {ARCHS}")
    kwargs = {**_COMMON, **_ARCH_CONFIGS[arch], **config_overrides}
    config = _make_config(arch, kwargs)
    torch.manual_seed(seed)
    if arch == "qwen3_5_mm":  # AutoModelForCausalLM builds the text model alone
        import transformers

        model = transformers.Qwen3_5ForConditionalGeneration._from_config(
            config, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    shard_size = max_shard_size or _DEFAULT_SHARD_SIZE.get(arch, "1GB")
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(str(path), max_shard_size=shard_size)
    return str(path)


def load_hf_model(path: str | os.PathLike[str]) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@torch.no_grad()
def hf_logits(path: str | os.PathLike[str] | torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """HF float32 logits for every position of one sequence: [len(token_ids), vocab_size]."""
    model = path if isinstance(path, torch.nn.Module) else load_hf_model(path)
    out = model(input_ids=torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def hf_greedy(
    path: str | os.PathLike[str], prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuation of each prompt with the HF model, one prompt at a time, exactly
    `max_new_tokens` tokens each (no EOS stopping). Returns only the generated ids."""
    model = load_hf_model(path)
    outputs = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_new_tokens):
            ids.append(int(hf_logits(model, ids)[-1].argmax()))
        outputs.append(ids[len(prompt) :])
    return outputs
