"""4-bit integer weight checkpoints (W4A16: activations stay in the model dtype), read from
config.json's `quantization_config`: GPTQ ("gptq", checkpoint_format "gptq" or "gptq_v2"), AWQ
("awq", GEMM layout) and compressed-tensors "pack-quantized" (llm-compressor's W4A16). Each
becomes an `Int4Scheme`; loading converts every layout to ferrum's one (kernels/int4_ref.py).
Anything else is a ValueError naming the field and what is supported."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LAYOUTS = ("gptq", "gptq_v2", "awq", "pack_quantized")


@dataclass(frozen=True)
class Int4Scheme:
    """`layout`: the checkpoint's tensor layout. `group_size`: input columns per scale, -1 for
    one scale per output row over all of K. `act_order`: a g_idx permutes the columns among the
    groups (GPTQ desc_act, compressed-tensors actorder). `has_zero`: zero points are stored
    (GPTQ, AWQ); without them codes are centred on 8 (symmetric)."""

    layout: str
    group_size: int
    act_order: bool
    has_zero: bool


def _fail(field_name: str, message: str) -> ValueError:
    return ValueError(f"quantization_config.{field_name}: {message}")


def _group_size(raw: dict[str, Any], key: str, where: str = "") -> int:
    value = raw.get(key, 128)
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise _fail(
            where + key, f"must be a positive integer or -1 (per output row), got {value!r}"
        )
    return value


def _four_bits(raw: dict[str, Any], key: str) -> None:
    if raw.get(key) != 4:
        raise _fail(key, f"{raw.get(key)!r} bits are not supported yet; supported: 4")


def parse_gptq(raw: dict[str, Any]) -> Int4Scheme:
    _four_bits(raw, "bits")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail("checkpoint_format", f"{fmt!r} is not supported; supported: gptq, gptq_v2")
    if raw.get("lm_head"):
        raise _fail("lm_head", "a quantized lm_head is not supported yet")
    if raw.get("dynamic"):
        raise _fail("dynamic", "per-module overrides are not supported yet")
    desc_act = raw.get("desc_act", False)
    if not isinstance(desc_act, bool):
        raise _fail("desc_act", f"must be true or false, got {desc_act!r}")
    return Int4Scheme(fmt, _group_size(raw, "group_size"), desc_act, has_zero=True)


def parse_awq(raw: dict[str, Any]) -> Int4Scheme:
    bits_key = "bits" if "bits" in raw else "w_bit"
    _four_bits(raw, bits_key)
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _fail("version", f"{version!r} is not supported; supported: 'gemm'")
    if raw.get("zero_point", True) is not True:
        raise _fail("zero_point", "AWQ without zero points is not supported; supported: true")
    key = "group_size" if "group_size" in raw else "q_group_size"
    return Int4Scheme("awq", _group_size(raw, key), act_order=False, has_zero=True)


def parse_pack_quantized(raw: dict[str, Any]) -> Int4Scheme:
    """compressed-tensors with format "pack-quantized": one config group over Linear layers."""
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _fail("config_groups", "exactly one quantization group is supported")
    ((name, group),) = groups.items()
    where = f"config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise _fail(f"{where}.targets", f"{group.get('targets')!r}; supported: ['Linear']")
    if group.get("input_activations") is not None:
        raise _fail(
            f"{where}.input_activations", "quantized activations with int4 weights (W4A8) are "
            "not supported yet; supported: none (W4A16)",
        )  # fmt: skip
    weights = group.get("weights") or {}
    if weights.get("type") != "int" or weights.get("num_bits") != 4:
        raise _fail(
            f"{where}.weights", f"type {weights.get('type')!r} with num_bits "
            f"{weights.get('num_bits')!r} is not supported; supported: int, 4",
        )  # fmt: skip
    if weights.get("symmetric") is not True:
        raise _fail(f"{where}.weights.symmetric", "asymmetric int4 is not supported yet")
    if weights.get("dynamic"):
        raise _fail(f"{where}.weights.dynamic", "must be false (weights are stored quantized)")
    strategy = weights.get("strategy")
    if strategy == "channel":
        group_size = -1
    elif strategy == "group":
        group_size = _group_size(weights, "group_size", f"{where}.weights.")
    else:
        raise _fail(f"{where}.weights.strategy", f"{strategy!r}; supported: group, channel")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "group", "weight"):
        raise _fail(f"{where}.weights.actorder", f"{actorder!r}; supported: group, weight, none")
    if actorder == "group" and strategy != "group":
        raise _fail(f"{where}.weights.actorder", "'group' needs the group strategy")
    # "weight" quantizes in activation order but keeps the groups contiguous: no g_idx.
    return Int4Scheme("pack_quantized", group_size, actorder == "group", has_zero=False)


def scheme_summary(scheme: Int4Scheme) -> str:
    group = "per channel" if scheme.group_size == -1 else f"group {scheme.group_size}"
    order = ", act-order" if scheme.act_order else ""
    return f"{scheme.layout} int4 ({group}{order})"
