"""Tiny FP8 checkpoints in the on-disk layouts of the real ones, written from a tiny fp32 one.

    write_fp8_checkpoint(src, dst, fmt, ignore=()) -> dst
        fmt "fp8":   Qwen's official layout: float8_e4m3fn `*.weight` and fp32 `*.weight_scale_inv`
                     [ceil(N / 128), ceil(K / 128)] per 128x128 block; config.json gets
                     {"quant_method": "fp8", "weight_block_size": [128, 128], ...,
                     "modules_to_not_convert": ignore}.
        fmt "compressed-tensors": llm-compressor's FP8_DYNAMIC: `*.weight` float8 and
                     `*.weight_scale` [N, 1] per output channel (stored bf16, as some checkpoints
                     do), config.json with one config group and `ignore`.
    write_dequantized_twin(fp8_dir, dst) -> dst
        the same model with every FP8 weight replaced by weight * scale in fp32 and no
        quantization_config: what the FP8 checkpoint means, loadable by transformers.
    fake_quantize_activations(hf_model, group) -> hf_model
        hooks that round the input of every quantized projection to FP8 as W8A8 does at run
        time (per token-group of `group` columns, or per token when group is None), so that the
        twin computes exactly what an FP8 engine computes, in fp32.
Only decoder-layer projections (`*_proj.weight` under model.layers, MoE experts included) are
quantized, except the checkpoint modules named in `ignore`. Scales follow the usual recipe (block
or row abs-max / 448), written here independently of ferrum's quantizer.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
_QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
# MoE experts (Qwen's per-expert layout); FP8 experts are weight-only: no activation rounding.
_EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def _block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    scale = torch.empty(rows, cols)
    codes = torch.empty(n, k, dtype=FP8)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * BLOCK : (r + 1) * BLOCK, c * BLOCK : (c + 1) * BLOCK].float()
            s = tile.abs().max().clamp(min=1e-10) / FP8_MAX
            scale[r, c] = s
            codes[r * BLOCK : (r + 1) * BLOCK, c * BLOCK : (c + 1) * BLOCK] = (tile / s).to(FP8)
    return codes, scale


def _channel_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    return (w.float() / scale).to(FP8), scale.to(torch.bfloat16)


def _quant_config(fmt: str, ignore: tuple[str, ...]) -> dict:
    if fmt == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": list(ignore),
        }
    args = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "ignore": ["lm_head", *ignore],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**args, "strategy": "channel", "dynamic": False},
                "input_activations": {**args, "strategy": "token", "dynamic": True},
            }
        },
    }


def _copy_folder(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for path in glob.glob(os.path.join(src, "*.json")):
        if not path.endswith("model.safetensors.index.json"):
            shutil.copy(path, dst)


def _edit_config(dst: str, quantization_config: dict | None) -> None:
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def _read_all(src: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors


def write_fp8_checkpoint(src: str, dst: str, fmt: str, ignore: tuple[str, ...] = ()) -> str:
    assert fmt in ("fp8", "compressed-tensors"), fmt
    _copy_folder(src, dst)
    _edit_config(dst, _quant_config(fmt, ignore))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in _read_all(src).items():
        module = name.removesuffix(".weight")
        if not (_QUANTIZED.match(name) or _EXPERT.match(name)) or module in ignore:
            out[name] = tensor
        elif fmt == "fp8":
            out[name], out[f"{module}.weight_scale_inv"] = _block_quantize(tensor)
        else:
            out[name], out[f"{module}.weight_scale"] = _channel_quantize(tensor)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_dequantized_twin(fp8_dir: str, dst: str) -> str:
    _copy_folder(fp8_dir, dst)
    _edit_config(dst, None)
    tensors = _read_all(fp8_dir)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            continue
        if tensor.dtype != FP8:
            out[name] = tensor
            continue
        module = name.removesuffix(".weight")
        w = tensor.float()
        if f"{module}.weight_scale_inv" in tensors:
            s = tensors[f"{module}.weight_scale_inv"].float()
            s = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[
                : w.shape[0], : w.shape[1]
            ]
        else:
            s = tensors[f"{module}.weight_scale"].float()
        out[name] = w * s
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _fake_quantize(x: torch.Tensor, group: int | None) -> torch.Tensor:
    cols = x.shape[-1]
    size = group or cols
    groups = x.float().reshape(-1, cols // size, size)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
    return ((groups / scale).to(FP8).float() * scale).reshape(x.shape).to(x.dtype)


def fake_quantize_activations(
    hf_model: torch.nn.Module, group: int | None, ignore: tuple[str, ...] = ()
) -> torch.nn.Module:
    for name, module in hf_model.named_modules():
        if _QUANTIZED.match(name + ".weight") and name not in ignore:
            module.register_forward_pre_hook(lambda _, args: (_fake_quantize(args[0], group),))
    return hf_model
