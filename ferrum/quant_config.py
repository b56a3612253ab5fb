"""How a model's linear layers are quantized (config.json's `quantization_config`, `quantization`),
resolved from config dicts into a typed QuantConfig. Supported, W8A8 FP8 e4m3 with dynamic
activations: "fp8" checkpoints (`weight_scale_inv` per 128x128 block), "compressed-tensors" FP8
(`weight_scale` per output channel or 128x128 block), each with its unquantized modules, and
`quantization="fp8"` on an unquantized checkpoint (128x128 blocks at load); and W4A16 int4:
GPTQ, AWQ and compressed-tensors "pack-quantized" (quant_config_int4.py). Anything else (static
activation scales, other block sizes, other bit widths) is a ValueError naming the field."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ferrum.quant_config_int4 import Int4Scheme, parse_awq, parse_gptq, parse_pack_quantized

QUANTIZATION_METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
# vLLM's names of the same formats on its Marlin kernels.
_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, *_ALIASES)
WEIGHT_BLOCK = (128, 128)
WEIGHT_SCALES = ("block", "channel")
_SUPPORTED = (
    "supported: 'fp8' (float8_e4m3fn weights with 128x128 block weight_scale_inv, dynamic "
    "activations; or --quantization fp8 on a bf16/fp16 checkpoint) and 'compressed-tensors' FP8 "
    "(per-channel or 128x128 block weight_scale, dynamic per-token/per-group activations); "
    "int4 W4A16: 'gptq', 'awq' (GEMM) and 'compressed-tensors' pack-quantized"
)


@dataclass(frozen=True)
class QuantConfig:
    """W8A8 FP8 linear layers. `weight_scales` "block": one fp32 scale per 128x128 weight block
    (activations quantized per token-group of 128); "channel": one per output row (activations
    per token). `scale_name` is the scale tensor's checkpoint suffix. `quantize_on_load`: the
    checkpoint holds unquantized weights that loading quantizes. `ignored_modules` are checkpoint
    module names kept in the model dtype: exact names, or "re:" + a regex matched at the start.
    `int4`: int4 weights (weight_scales "int4") in this scheme instead of FP8."""

    method: str
    weight_scales: str
    scale_name: str
    quantize_on_load: bool
    ignored_modules: tuple[str, ...] = ()
    int4: Int4Scheme | None = None

    def is_ignored(self, module_name: str) -> bool:
        """Whether the checkpoint module `module_name` (e.g. "model.layers.0.mlp.down_proj") is
        left unquantized. Plain entries also match as a dotted suffix ("lm_head", "mlp.gate")."""
        for entry in self.ignored_modules:
            if entry.startswith("re:"):
                if re.match(entry[3:], module_name):
                    return True
            elif module_name == entry or module_name.endswith("." + entry):
                return True
        return False


def _fail(field_name: str, message: str) -> ValueError:
    return ValueError(f"{field_name}: {message}")


def resolve_quant_config(quantization: str | None, hf_config: dict[str, Any]) -> QuantConfig | None:
    """The QuantConfig for the `quantization` argument and the checkpoint's config.json (None:
    no quantization). They must agree when both are given."""
    given = quantization
    quantization = _ALIASES.get(quantization, quantization) if quantization else quantization
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise _fail(
            "quantization",
            f"{quantization!r} is not supported; supported: {list(QUANTIZATION_METHODS)}",
        )
    raw = hf_config.get("quantization_config")
    if raw is None:
        if quantization is None:
            return None
        if quantization != "fp8":
            raise _fail(
                "quantization",
                f"{quantization!r} describes a quantized checkpoint, but config.json has no "
                "quantization_config; use 'fp8' to quantize a bf16/fp16 checkpoint while loading",
            )
        return QuantConfig("fp8", "block", "weight_scale_inv", quantize_on_load=True)
    if not isinstance(raw, dict):
        raise _fail("quantization_config", f"must be a JSON object in config.json, got {raw!r}")
    method = raw.get("quant_method")
    if quantization is not None and quantization != method:
        raise _fail(
            "quantization",
            f"{given!r} does not match the checkpoint's quantization_config.quant_method "
            f"{method!r} (leave quantization unset to use the checkpoint's)",
        )
    if method == "fp8":
        return _parse_fp8(raw)
    if method == "compressed-tensors" and raw.get("format") == "pack-quantized":
        return _int4(method, parse_pack_quantized(raw), "weight_scale", _names(raw, "ignore"))
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    if method == "gptq":
        return _int4(method, parse_gptq(raw), "scales", ())
    if method == "awq":
        # AutoAWQ (and vLLM) skip a module whose name contains an entry.
        skipped = tuple("re:.*" + re.escape(n) for n in _names(raw, "modules_to_not_convert"))
        return _int4(method, parse_awq(raw), "scales", skipped)
    raise _fail("quantization_config.quant_method", f"{method!r} is not supported; {_SUPPORTED}")


def _int4(
    method: str, scheme: Int4Scheme, scale_name: str, ignored: tuple[str, ...]
) -> QuantConfig:
    return QuantConfig(method, "int4", scale_name, False, ignored, scheme)


def _names(raw: dict[str, Any], key: str) -> tuple[str, ...]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(f"quantization_config.{key}", f"must be a list of module names, got {value!r}")
    return tuple(value)


def _parse_fp8(raw: dict[str, Any]) -> QuantConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _fail("quantization_config.fmt", f"{fmt!r} is not supported; supported: 'e4m3'")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _fail(
            "quantization_config.activation_scheme",
            f"{scheme!r} (static activation scales) is not supported yet; supported: 'dynamic'",
        )
    block = raw.get("weight_block_size")
    if block is None or list(block) != list(WEIGHT_BLOCK):
        raise _fail(
            "quantization_config.weight_block_size",
            f"{block!r} is not supported; supported: {list(WEIGHT_BLOCK)} (per-tensor FP8 "
            "checkpoints without block scales are not supported yet)",
        )
    ignored = _names(raw, "modules_to_not_convert") + _names(raw, "ignored_layers")
    return QuantConfig("fp8", "block", "weight_scale_inv", False, ignored)


def _parse_compressed_tensors(raw: dict[str, Any]) -> QuantConfig:
    where = "quantization_config"
    fmt = raw.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _fail(
            f"{where}.format",
            f"{fmt!r} is not supported; supported: 'float-quantized', 'naive-quantized' (FP8) "
            "and 'pack-quantized' (int4 W4A16)",
        )
    if raw.get("kv_cache_scheme") is not None:
        raise _fail(f"{where}.kv_cache_scheme", "an FP8 KV cache scheme is not supported yet")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _fail(
            f"{where}.config_groups",
            "exactly one quantization group is supported (one scheme for every linear layer)",
        )
    ((name, group),) = groups.items()
    where = f"{where}.config_groups.{name}"
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise _fail(f"{where}.targets", f"{targets!r} is not supported; supported: ['Linear']")
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    _check_fp8_args(f"{where}.weights", weights)
    if weights.get("dynamic"):
        raise _fail(f"{where}.weights.dynamic", "must be false (weights are stored quantized)")
    if not isinstance(acts, dict):
        raise _fail(
            f"{where}.input_activations",
            "weight-only FP8 (W8A16) is not supported yet; supported: dynamic FP8 activations",
        )
    _check_fp8_args(f"{where}.input_activations", acts)
    if acts.get("dynamic") is not True:
        raise _fail(
            f"{where}.input_activations.dynamic",
            "static activation scales are not supported yet; supported: dynamic (true)",
        )
    strategy = weights.get("strategy")
    if strategy == "channel":
        wanted = ("token", None)
    elif strategy == "block":
        block = weights.get("block_structure")
        if block is None or list(block) != list(WEIGHT_BLOCK):
            raise _fail(
                f"{where}.weights.block_structure",
                f"{block!r} is not supported; supported: {list(WEIGHT_BLOCK)}",
            )
        wanted = ("group", WEIGHT_BLOCK[1])
    else:
        raise _fail(
            f"{where}.weights.strategy",
            f"{strategy!r} is not supported; supported: 'channel', 'block'",
        )
    got = (acts.get("strategy"), acts.get("group_size"))
    if got[0] != wanted[0] or (wanted[1] is not None and got[1] != wanted[1]):
        raise _fail(
            f"{where}.input_activations.strategy",
            f"{got[0]!r} (group_size {got[1]!r}) with {strategy} weights is not supported; "
            f"supported: {wanted[0]!r}" + (f" with group_size {wanted[1]}" if wanted[1] else ""),
        )
    return QuantConfig("compressed-tensors", strategy, "weight_scale", False, _names(raw, "ignore"))


def _check_fp8_args(where: str, args: dict[str, Any]) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise _fail(
            where,
            f"type {args.get('type')!r} with num_bits {args.get('num_bits')!r} is not supported; "
            "supported: FP8 (type 'float', num_bits 8)",
        )
    if args.get("symmetric") is False:
        raise _fail(f"{where}.symmetric", "asymmetric FP8 is not supported; supported: true")
