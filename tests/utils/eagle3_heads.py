"""Tiny EAGLE-3 heads in the public checkpoints' format, for the tiny targets of
tests/utils/tiny_checkpoints.py (hidden 64, vocab 384): config.json of a LlamaForCausalLMEagle3
and model.safetensors with `midlayer.*`, `fc.weight`, `norm.weight`, `lm_head.weight`, `d2t`
and `t2d` (no `embed_tokens.weight`: the target's embedding is shared).

    head_config(**overrides) -> dict                          # config.json's keys
    random_head_tensors(config, seed) -> dict[str, Tensor]    # std 0.15, norms 1 + 0.1 noise
    write_head(path, config, tensors) -> str                  # the folder
    write_successor_target(src, dst), successor_head_tensors(target, config): a target whose
        greedy continuation is t + 1 and a head that proposes it (its first draft)
    reference_head(tensors, config, embeds, hidden) -> (normed, pre-norm): an independent
        torch implementation of the head over one sequence
The random heads' draft vocabulary is 256 of the 384 target ids (d2t maps them, in order)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

DRAFT_VOCAB = 256


def head_config(**overrides: Any) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "vocab_size": 384,
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
        **overrides,
    }


def random_head_tensors(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    num_aux = len(config.get("eagle_aux_hidden_state_layer_ids") or (0, 0, 0))
    draft_vocab, vocab = config["draft_vocab_size"], config["vocab_size"]
    shapes = {
        "fc.weight": (h, num_aux * config.get("target_hidden_size", h)),
        "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * d),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "lm_head.weight": (draft_vocab, h),
    }
    tensors = {
        name: 0.15 * torch.randn(shape, generator=generator) for name, shape in shapes.items()
    }
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm"):
        tensors[f"{name}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=generator)
    for name in ("midlayer.post_attention_layernorm", "norm"):
        tensors[f"{name}.weight"] = 1.0 + 0.1 * torch.randn(h, generator=generator)
    target_ids = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    tensors["d2t"] = target_ids - torch.arange(draft_vocab)
    tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    tensors["t2d"][target_ids] = True
    return tensors


def write_head(
    path: str | os.PathLike[str], config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return write_tensors(path, tensors)


def write_successor_target(src: str, dst: str | os.PathLike[str]) -> str:
    """A copy of the single-file tiny checkpoint `src` whose decoder layers add nothing
    (o_proj and down_proj zero: every layer's input is the token's embedding) and whose LM head
    scores token j by the embedding of j - 1 (final norm weight one): its greedy next token is
    t + 1 (mod vocab) after any token t."""
    from safetensors.torch import load_file

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                g.write(f.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t.zero_()
    tensors["model.norm.weight"].fill_(1.0)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].roll(1, dims=0).clone()
    return write_tensors(dst, tensors)


def successor_head_tensors(target: str, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A head for `write_successor_target`'s target that fuses the first aux layer as is and
    adds nothing to it (o_proj, down_proj zero): at the row of token t it proposes t + 2, the
    target's greedy token after the next; its draft vocabulary is the whole one, reversed
    (draft id i is target id vocab - 1 - i), so d2t is exercised."""
    from safetensors.torch import load_file

    embedding = load_file(os.path.join(target, "model.safetensors"))["model.embed_tokens.weight"]
    vocab, h = embedding.shape
    tensors = random_head_tensors({**config, "draft_vocab_size": vocab}, seed=0)
    fc = torch.zeros_like(tensors["fc.weight"])
    fc[:, :h] = torch.eye(h)
    tensors["fc.weight"] = fc
    for name in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        tensors[name].zero_()
    tensors["norm.weight"].fill_(1.0)
    target_ids = torch.arange(vocab - 1, -1, -1)
    tensors["lm_head.weight"] = embedding[(target_ids - 2) % vocab].clone()
    tensors["d2t"] = target_ids - torch.arange(vocab)
    tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    return tensors


def write_tensors(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor]) -> str:
    save_file({name: t.contiguous() for name, t in tensors.items()}, f"{path}/model.safetensors")
    return str(path)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of x [tokens, heads, dim]."""
    dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * inv_freq[None, :]
    cos = torch.cat([angles.cos()] * 2, -1)[:, None]
    sin = torch.cat([angles.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], dim=-1)
    return x * cos + half * sin


def reference_head(
    t: dict[str, torch.Tensor],
    config: dict,
    embeds: torch.Tensor,
    hidden: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, causal: row i from the next token's embedding and hidden state i ->
    (normed output, pre-norm output)."""
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n = embeds.shape[0]
    x = torch.cat([rms(embeds, t["midlayer.input_layernorm.weight"]),
                   rms(hidden, t["midlayer.hidden_norm.weight"])], dim=-1)  # fmt: skip
    positions = torch.arange(n)
    q = rope((x @ t["midlayer.self_attn.q_proj.weight"].T).view(n, heads, d), positions, 1e6)
    k = rope((x @ t["midlayer.self_attn.k_proj.weight"].T).view(n, kv, d), positions, 1e6)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(n, kv, d)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    residual = hidden + attn @ t["midlayer.self_attn.o_proj.weight"].T
    y = rms(residual, t["midlayer.post_attention_layernorm.weight"])
    gate, up = y @ t["midlayer.mlp.gate_proj.weight"].T, y @ t["midlayer.mlp.up_proj.weight"].T
    residual = residual + (F.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T
    return rms(residual, t["norm.weight"]), residual
