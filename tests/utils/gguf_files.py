"""Writes GGUF files of tiny Hugging Face checkpoints for tests, with their dequantized twins.

`write_gguf(hf_dir, out_dir, gguf_arch, types)` writes `out_dir/model.gguf` the way llama.cpp's
converter lays a model out (its tensor names, metadata keys, Llama's Q/K rows reordered, experts
stacked [E, out, in]) and `out_dir/twin/`: a Hugging Face folder holding exactly the values the
GGUF file decodes to (`gguf.quants.dequantize` of what was written), for transformers to run.
`types(gguf_name, shape)` picks each tensor's type: F32, F16, BF16 and Q8_0 are quantized with
`gguf.quants.quantize`; Q4_K, Q5_K and Q6_K (which the library cannot quantize) are random valid
blocks: random bytes with finite, positive fp16 super-block scales sized so the values have a
standard deviation near the checkpoint's.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ferrum.default_model import DEFAULT_MODEL_DIR

TypeChooser = Callable[[str, tuple[int, ...]], str]
# Byte offsets of each K-quant block's fp16 super-block scales (d, then dmin where there is one),
# and the dmin/d ratio that centres its values near zero (the mean quant times the mean scale).
_K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
_K_DMIN_RATIO = {"Q4_K": 7.5, "Q5_K": 15.5}
_TARGET_STD = 0.15
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)_proj\.weight$")


def llama_rotary_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """llama.cpp's Llama Q/K row order: row 2j + h of each head holds Hugging Face's row
    h * head_dim / 2 + j (rotary halves interleaved)."""
    head_dim = num_rows // num_heads
    half = head_dim // 2
    return np.array(
        [h * head_dim + t * half + j for h in range(num_heads) for j in range(half) for t in (0, 1)]
    )


def ggml_vocab(tokenizer_dir: str = DEFAULT_MODEL_DIR) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, token types, merges "a b") of a byte-level BPE tokenizer.json, as llama.cpp
    stores them (added special tokens are type 3, control; the others 1, normal)."""
    data = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(data["model"]["vocab"])
    special = set()
    for added in data["added_tokens"]:
        vocab[added["content"]] = added["id"]
        if added["special"]:
            special.add(added["id"])
    tokens = [""] * (max(vocab.values()) + 1)
    for token, token_id in vocab.items():
        tokens[token_id] = token
    types = [3 if i in special else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


def random_k_blocks(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random valid `kind` blocks for a tensor of `shape` (last dim a multiple of 256), as the
    uint8 array the GGUF writer takes."""
    qtype = gguf.GGMLQuantizationType[kind]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    num_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, (num_blocks, type_size), dtype=np.uint8)

    def set_scales(d: np.ndarray) -> None:
        ratio = [1.0, _K_DMIN_RATIO.get(kind, 0.0)]
        for offset, r in zip(_K_SCALE_OFFSETS[kind], ratio):
            blocks[:, offset : offset + 2] = (
                (d * r).astype(np.float16).view(np.uint8).reshape(-1, 2)
            )

    unit = rng.uniform(0.5, 1.5, num_blocks)
    set_scales(unit)
    byte_shape = (*shape[:-1], shape[-1] // block_size * type_size)
    std = float(gguf.quants.dequantize(blocks.reshape(byte_shape), qtype).std())
    set_scales(unit * _TARGET_STD / std)
    return blocks.reshape(byte_shape)


def _encode(values: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """`values` as the array the GGUF writer stores for type `kind`."""
    if kind in _K_SCALE_OFFSETS:
        return random_k_blocks(values.shape, kind, rng)
    if kind == "F32":
        return values.astype(np.float32)
    if kind == "F16":
        return values.astype(np.float16)
    return gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType[kind])


def _decode(data: np.ndarray, kind: str) -> np.ndarray:
    if kind in ("F32", "F16"):
        return data.astype(np.float32)
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).astype(np.float32)


def _read_hf(hf_dir: str) -> dict[str, np.ndarray]:
    tensors = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(path), "np") as handle:
            for name in handle.keys():  # noqa: SIM118
                tensors[name] = handle.get_tensor(name)
    return tensors


def _gguf_tensors(hf: dict[str, np.ndarray], num_experts: int) -> dict[str, tuple[str, ...]]:
    """GGUF name -> the Hugging Face names whose tensors it holds (stacked for experts)."""
    names: dict[str, tuple[str, ...]] = {}
    for name in hf:
        if name in _GLOBAL:
            names[_GLOBAL[name]] = (name,)
        elif (expert := _HF_EXPERT.match(name)) is not None:
            layer, _, proj = expert.groups()
            stacked = f"model.layers.{layer}.mlp.experts.{{}}.{proj}_proj.weight"
            names[f"blk.{layer}.ffn_{proj}_exps.weight"] = tuple(
                stacked.format(e) for e in range(num_experts)
            )
        else:
            layer, module, suffix = _HF_LAYER.match(name).groups()  # type: ignore[union-attr]
            names[f"blk.{layer}.{_LAYER[module]}.{suffix}"] = (name,)
    return names


def _num_experts(config: dict[str, Any]) -> int:
    return int(config.get("num_experts") or config.get("num_local_experts") or 0)


def _write_metadata(
    writer: Any, arch: str, config: dict[str, Any], tokenizer: dict[str, Any]
) -> None:
    """llama.cpp's metadata keys for `config` and the tokenizer of `tokenizer["dir"]`."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    writer.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    writer.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    writer.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    writer.add_uint32(f"{arch}.attention.head_count", heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
    writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    writer.add_float32(f"{arch}.rope.freq_base", theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    if _num_experts(config):
        writer.add_uint32(f"{arch}.expert_count", _num_experts(config))
        writer.add_uint32(f"{arch}.expert_used_count", config["num_experts_per_tok"])
        writer.add_uint32(f"{arch}.expert_feed_forward_length", config["moe_intermediate_size"])
    tokens, types, merges = ggml_vocab(tokenizer["dir"])
    writer.add_string("tokenizer.ggml.model", tokenizer.get("model", "gpt2"))
    writer.add_string("tokenizer.ggml.pre", tokenizer.get("pre", "gpt-2"))
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", merges)
    for name, token_id in tokenizer.get("ids", {}).items():
        writer.add_uint32(f"tokenizer.ggml.{name}_token_id", token_id)
    writer.add_bool("tokenizer.ggml.add_bos_token", tokenizer.get("add_bos", False))
    if tokenizer.get("chat_template"):
        writer.add_string("tokenizer.chat_template", tokenizer["chat_template"])


def write_gguf(
    hf_dir: str,
    out_dir: Path,
    arch: str,
    types: TypeChooser,
    tokenizer: dict[str, Any],
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> tuple[str, str]:
    """Writes `out_dir/model.gguf` and its twin `out_dir/twin`; returns both paths. `tokenizer`:
    {"dir": tokenizer folder, "pre": ..., "ids": {"eos": 2, "padding": 0, ...}, "add_bos": bool,
    "chat_template": str, "model": "gpt2"}. `extra_tensors` are written as they are (F32 for
    float32 arrays), first, and are not part of the twin (e.g. `rope_freqs.weight`)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    hf = _read_hf(hf_dir)
    twin: dict[str, np.ndarray] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, arch, config, tokenizer)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    for gguf_name, hf_names in _gguf_tensors(hf, _num_experts(config)).items():
        values = np.stack([hf[n] for n in hf_names]) if len(hf_names) > 1 else hf[hf_names[0]]
        rows = None
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config[
                "num_attention_heads" if "attn_q" in gguf_name else "num_key_value_heads"
            ]
            rows = llama_rotary_rows(values.shape[0], heads)
            values = values[rows]
        kind = types(gguf_name, values.shape)
        rng = np.random.default_rng(sum(gguf_name.encode()))
        data = _encode(values, kind, rng)
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(gguf_name, data, raw_dtype=None if kind in ("F32", "F16") else qtype)
        decoded = _decode(data, kind)
        if rows is not None:
            decoded = decoded[np.argsort(rows)]
        for i, hf_name in enumerate(hf_names):
            twin[hf_name] = decoded[i] if len(hf_names) > 1 else decoded
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    twin_dir = out_dir / "twin"
    twin_dir.mkdir(exist_ok=True)
    shutil.copy(Path(hf_dir) / "config.json", twin_dir / "config.json")
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in twin.items()}
    save_file(tensors, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    return str(path), str(twin_dir)


def llama3_rope_divisors(hf_dir: str) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp writes for a llama3-scaled checkpoint: how much the
    scaling divides each frequency, from transformers' own llama3 frequencies."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(hf_dir)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    theta = config.rope_parameters["rope_theta"]
    head_dim = config.head_dim
    plain = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (plain / scaled.double()).numpy().astype(np.float32)
