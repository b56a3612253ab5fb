"""Tiny int4 checkpoints in the on-disk layouts of the real ones, written from a tiny fp32 one by
packers written here from each format's description (independent of ferrum's loader).

    write_int4_checkpoint(src, dst, fmt, group_size=32, sym=True, act_order=False) -> (dst, twin)
        fmt "gptq":  qweight int32 [K/8, N] (code of row 8r+i in bits 4i of word (r, n)), qzeros
                     int32 [G, N/8] (zero - 1, 8 along N), scales fp16 [G, N], g_idx int32 [K];
                     config {"quant_method": "gptq", "bits": 4, "desc_act", "sym", ...}.
        fmt "awq":   qweight int32 [K, N/8] and qzeros [G, N/8], nibble i of word c holding column
                     8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]; scales fp16 [G, N]; {"quant_method": "awq",
                     "version": "gemm", "zero_point": true, ...}.
        fmt "ct":    compressed-tensors pack-quantized: weight_packed int32 [N, K/8] (signed code
                     + 8 in bits 4i), weight_scale fp16 [N, G], weight_shape, weight_g_idx with
                     act-order; one config group {"weights": {"type": "int", "num_bits": 4, ...}}.
        group_size -1: one group over all of K. `twin` (dst + "-twin"): the same model with each
        quantized weight replaced by what the checkpoint means ((code - zero) * fp16 scale),
        loadable by transformers.
Decoder-layer projections (`*_proj.weight` under model.layers, MoE experts included) are
quantized; with act_order the columns go to groups in a random order (g_idx)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch
from safetensors.torch import save_file

from tests.utils.fp8_checkpoints import _copy_folder, _edit_config, _read_all

_QUANTIZED = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.)?\w+_proj\.weight$")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _quantize(w: torch.Tensor, group: int, sym: bool, g_idx: np.ndarray):  # noqa: ANN202
    """codes [N, K] 0..15, zeros [N, G] 0..15, fp16 scales [N, G] of w [N, K]."""
    n, k = w.shape
    groups = k // group
    w = w.double().numpy()
    codes, zeros = np.zeros((n, k), np.int64), np.zeros((n, groups), np.int64)
    scales = np.zeros((n, groups), np.float16)
    for g in range(groups):
        cols = np.nonzero(g_idx == g)[0]
        block = w[:, cols]
        if sym:
            scale = (np.abs(block).max(1) / 7.0).astype(np.float16).astype(np.float64)
            zero = np.full(n, 8)
        else:
            lo, hi = np.minimum(block.min(1), 0), np.maximum(block.max(1), 0)
            scale = ((hi - lo) / 15.0).astype(np.float16).astype(np.float64)
            zero = np.clip(np.round(-lo / np.maximum(scale, 1e-12)), 0, 15).astype(np.int64)
        scale = np.maximum(scale, 1e-6)
        q = np.clip(np.round(block / scale[:, None]) + zero[:, None], 0, 15)
        codes[:, cols], zeros[:, g], scales[:, g] = q, zero, scale
    return codes, zeros, scales


def _pack(values: np.ndarray, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """[..., 8W] 0..15 -> [..., W] int32: nibble i of word c holds value 8c + order[i]."""
    grouped = values.reshape(*values.shape[:-1], -1, 8).astype(np.uint64)
    words = np.zeros(grouped.shape[:-1], np.uint64)
    for i in range(8):
        words |= grouped[..., order[i]] << np.uint64(4 * i)
    return words.astype(np.uint32).view(np.int32)


def _g_idx(k: int, group: int, act_order: bool, seed: int) -> np.ndarray:
    base = np.arange(k) // group
    if not act_order:
        return base
    return base[np.random.default_rng(seed).permutation(k)]


def _tensors(fmt: str, module: str, codes, zeros, scales, g_idx, shape) -> dict:  # noqa: ANN001
    t = {}
    if fmt == "gptq":
        t["qweight"] = _pack(codes).T
        t["qzeros"] = _pack((zeros.T - 1) & 0xF)
        t["scales"], t["g_idx"] = scales.T, g_idx.astype(np.int32)
    elif fmt == "awq":
        t["qweight"] = _pack(codes.T, AWQ_ORDER)
        t["qzeros"], t["scales"] = _pack(zeros.T, AWQ_ORDER), scales.T
    else:
        t["weight_packed"], t["weight_scale"] = _pack(codes), scales
        t["weight_shape"] = np.array(shape, np.int64)
        if not np.array_equal(g_idx, np.arange(len(g_idx)) // (len(g_idx) // scales.shape[1])):
            t["weight_g_idx"] = g_idx.astype(np.int32)
    return {f"{module}.{name}": torch.from_numpy(np.ascontiguousarray(v)) for name, v in t.items()}


def _config(fmt: str, group: int, sym: bool, act_order: bool) -> dict:
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                "sym": sym, "checkpoint_format": "gptq", "lm_head": False}  # fmt: skip
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                "zero_point": True, "modules_to_not_convert": None}  # fmt: skip
    weights = {
        "type": "int", "num_bits": 4, "symmetric": True, "dynamic": False,
        "strategy": "channel" if group == -1 else "group",
        "group_size": None if group == -1 else group,
        "actorder": "group" if act_order else None,
    }  # fmt: skip
    group_0 = {"targets": ["Linear"], "weights": weights, "input_activations": None}
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": group_0}, "ignore": ["lm_head"],
    }  # fmt: skip


def write_int4_checkpoint(
    src: str, dst: str, fmt: str, group_size: int = 32, sym: bool = True, act_order: bool = False
) -> tuple[str, str]:
    """(int4 dir, dequantized twin dir at dst + "-twin")."""
    assert fmt in ("gptq", "awq", "ct") and (sym or fmt != "ct")
    twin = dst + "-twin"
    for folder, config in ((dst, _config(fmt, group_size, sym, act_order)), (twin, None)):
        _copy_folder(src, folder)
        _edit_config(folder, config)
    quantized, dequantized = {}, {}
    for name, w in sorted(_read_all(src).items()):
        if not _QUANTIZED.match(name):
            quantized[name] = dequantized[name] = w
            continue
        module, (n, k) = name.removesuffix(".weight"), w.shape
        group = k if group_size == -1 else group_size
        # Projections of one input (q, k, v; gate, up) share GPTQ's column order, as real ones.
        same_input = re.sub(r"\.(q|k|v)_proj$", ".qkv", re.sub(r"\.(gate|up)_proj$", ".gu", module))
        g_idx = _g_idx(k, group, act_order, seed=sum(map(ord, same_input)))
        codes, zeros, scales = _quantize(w, group, sym, g_idx)
        if fmt == "ct":
            zeros = np.full_like(zeros, 8)
        quantized |= _tensors(fmt, module, codes, zeros, scales, g_idx, (n, k))
        values = (codes - zeros[:, g_idx]) * scales.astype(np.float64)[:, g_idx]
        dequantized[name] = torch.from_numpy(values).float()
    save_file(quantized, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, os.path.join(twin, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"]
    return dst, twin
