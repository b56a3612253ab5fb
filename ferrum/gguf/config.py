"""A GGUF file's metadata as the Hugging Face config.json dict ModelConfig reads.

Keys follow llama.cpp's names (`{arch}.block_count`, `{arch}.attention.head_count`, ...); facts
the metadata leaves implicit come from the tensors: the vocabulary (token_embd rows), tied
embeddings (no output.weight), q/k/v biases, and Qwen3-MoE's dense layers (no ffn_gate_inp).
"""

from __future__ import annotations

import re
from typing import Any

from ferrum.gguf.reader import GGUFFile, open_gguf
from ferrum.gguf.rope import rope_scaling_of

# general.architecture -> config.json architectures[0]
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
_FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_ROUTER = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")


def gguf_architecture(file: GGUFFile) -> str:
    """general.architecture, or a ValueError naming it and the supported ones."""
    arch = file.field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {file.path}: general.architecture {arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def _tensor_shapes(file: GGUFFile) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in torch order (outermost dimension first)."""
    return {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in file.tensors}


def read_gguf_config(path: str) -> dict[str, Any]:
    """The config.json dict of the model in GGUF file `path`."""
    file = open_gguf(path)
    arch = gguf_architecture(file)
    shapes = _tensor_shapes(file)
    if "token_embd.weight" not in shapes:
        raise ValueError(f"GGUF file {path}: tensor token_embd.weight is missing")

    def get(key: str, kind: type = int, default: Any = ...) -> Any:
        return file.field(f"{arch}.{key}", kind, *(() if default is ... else (default,)))

    num_layers = get("block_count")
    num_heads = get("attention.head_count")
    hidden_size = get("embedding_length")
    head_dim = get("attention.key_length", int, hidden_size // max(num_heads, 1))
    rope_theta = get("rope.freq_base", float, 10000.0)
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden_size,
        "intermediate_size": get("feed_forward_length", int, 0) or None,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", int, num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", int, 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", float, 1e-6),
        "hidden_act": "silu",
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling_of(file, arch, rope_theta, head_dim),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        **_special_token_ids(file),
    }
    # The dtype "auto" loads: the embedding's float type, else bfloat16 (quantized files).
    embed = next(t for t in file.tensors if t.name == "token_embd.weight")
    config["torch_dtype"] = _FLOAT_DTYPES.get(embed.tensor_type.name, "bfloat16")
    if config["intermediate_size"] is None and "blk.0.ffn_gate.weight" in shapes:
        config["intermediate_size"] = shapes["blk.0.ffn_gate.weight"][0]
    if arch == "qwen3moe":
        config.update(_moe_config(file, arch, num_layers, shapes))
    return config


def _moe_config(
    file: GGUFFile, arch: str, num_layers: int, shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """Expert counts and sizes; layers without a router are dense (`mlp_only_layers`)."""
    routed = {int(m.group(1)) for name in shapes if (m := _ROUTER.match(name))}
    num_experts = file.field(f"{arch}.expert_count", int)
    moe_size = file.field(f"{arch}.expert_feed_forward_length", int, 0)
    if not moe_size and "blk.0.ffn_down_exps.weight" in shapes:
        moe_size = shapes["blk.0.ffn_down_exps.weight"][2]
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": file.field(f"{arch}.expert_used_count", int),
        "moe_intermediate_size": moe_size,
        # llama.cpp's qwen3moe graph renormalizes the top-k weights unless told otherwise.
        "norm_topk_prob": file.field(f"{arch}.expert_weights_norm", bool, True),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(num_layers) if i not in routed],
    }


def _special_token_ids(file: GGUFFile) -> dict[str, Any]:
    """bos / eos / pad ids for config.json; eos lists the end-of-turn token too when it differs."""
    ids: dict[str, Any] = {}
    for name, gguf_name in (("bos", "bos"), ("pad", "padding")):
        value = file.field(f"tokenizer.ggml.{gguf_name}_token_id", int, None)
        if value is not None:
            ids[f"{name}_token_id"] = value
    eos = [
        value
        for name in ("eos", "eot")
        if (value := file.field(f"tokenizer.ggml.{name}_token_id", int, None)) is not None
    ]
    if eos:
        ids["eos_token_id"] = eos[0] if len(set(eos)) == 1 else list(dict.fromkeys(eos))
    return ids
