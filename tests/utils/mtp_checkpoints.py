"""Tiny Qwen3.5 checkpoints with a multi-token-prediction layer (`mtp.*` tensors, config
`mtp_num_hidden_layers: 1`), as the public Qwen3.5 checkpoints hold one, and an independent
reference of the head built from transformers' Qwen3.5 decoder layer.

    with_mtp(src, dst, seed) -> str            # src's checkpoint plus random mtp.* (std 0.15)
    reference_mtp_drafts(hf, tensors, tokens, k) -> list[int]
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

INIT_STD = 0.15


def mtp_shapes(config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Each mtp.* tensor's shape for a Qwen3.5 text config; the MLP's (dense or MoE) are those
    of the target's layer 0 in `tensors`."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    kv, d = config["num_key_value_heads"], config["head_dim"]
    layer = "mtp.layers.0."
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        layer + "self_attn.q_proj.weight": (2 * heads * d, h),
        layer + "self_attn.k_proj.weight": (kv * d, h),
        layer + "self_attn.v_proj.weight": (kv * d, h),
        layer + "self_attn.o_proj.weight": (h, heads * d),
        layer + "self_attn.q_norm.weight": (d,),
        layer + "self_attn.k_norm.weight": (d,),
    }
    for name, tensor in tensors.items():
        if ".layers.0.mlp." in name:
            shapes[layer + "mlp." + name.split(".layers.0.mlp.", 1)[1]] = tuple(tensor.shape)
    for norm in ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm"):
        shapes[f"{norm}.weight"] = (h,)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        shapes[f"{layer}{norm}.weight"] = (h,)
    return shapes


def with_mtp(src: str, dst: str | os.PathLike[str], seed: int = 0) -> str:
    """A copy of the tiny checkpoint `src` with random mtp.* tensors beside its own."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["mtp_num_hidden_layers"] = 1
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name, shape in mtp_shapes(config, tensors).items():
        noise = torch.randn(shape, generator=generator)
        tensors[name] = 0.1 * noise if len(shape) == 1 else INIT_STD * noise  # norms: 1 + w
    save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


@torch.inference_mode()
def reference_mtp_drafts(
    hf: torch.nn.Module, tensors: dict[str, torch.Tensor], tokens: list[int], k: int
) -> list[int]:
    """Row p: the target's final hidden state at p with token p + 1 (transformers' model);
    draft 1 from the last row, each further draft from a row of its own (the head's output and
    the previous draft), attending to every row before it."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    config = hf.config
    full = config.layer_types.index("full_attention")
    layer = Qwen3_5DecoderLayer(config, full).eval()
    prefix = "mtp.layers.0."
    layer.load_state_dict({n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)})
    eps, embed = config.rms_norm_eps, tensors["model.embed_tokens.weight"]
    hidden = hf.model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state[0]
    ids, drafts = list(tokens[1:]), []
    for _ in range(k):
        n = len(ids)
        x = torch.cat(
            [
                _norm(embed[ids], tensors["mtp.pre_fc_norm_embedding.weight"], eps),
                _norm(hidden, tensors["mtp.pre_fc_norm_hidden.weight"], eps),
            ],
            dim=-1,
        )
        x = x @ tensors["mtp.fc.weight"].T
        positions = torch.arange(n)[None]
        cos_sin = hf.model.rotary_emb(x[None], positions)
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x[None], cos_sin, attention_mask=mask, position_ids=positions)[0]
        out = _norm(out, tensors["mtp.norm.weight"], eps)
        drafts.append(int((out[-1] @ tensors["lm_head.weight"].T).argmax()))
        hidden, ids = torch.cat([hidden, out[-1:]]), ids + [drafts[-1]]
    return drafts
