"""Resolving the `quantization` argument and config.json's quantization_config into QuantConfig;
every unsupported config is an error naming its field and what is supported."""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil

import pytest

from ferrum.config import ModelConfig
from ferrum.engine.arg_utils import EngineArgs
from ferrum.quant_config import QuantConfig, resolve_quant_config

QWEN_FP8 = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
_ARGS = {"num_bits": 8, "type": "float", "symmetric": True}
CT_CHANNEL = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "ignore": ["lm_head", "re:.*mlp\\.gate$"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {**_ARGS, "strategy": "channel", "dynamic": False},
            "input_activations": {**_ARGS, "strategy": "token", "dynamic": True},
        }
    },
}


def _with(config: dict, path: tuple[str, ...], value: object) -> dict:
    """A deep copy of `config` with the key at `path` set to `value` (deleted when None)."""
    out = copy.deepcopy(config)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def _ct_group(*keys: str) -> tuple[str, ...]:
    return ("config_groups", "group_0", *keys)


def test_qwen_fp8_checkpoint() -> None:
    config = resolve_quant_config(None, {"quantization_config": QWEN_FP8})
    assert config == QuantConfig("fp8", "block", "weight_scale_inv", False, ())
    ignored = {**QWEN_FP8, "modules_to_not_convert": ["lm_head", "model.layers.3.mlp.down_proj"]}
    config = resolve_quant_config("fp8", {"quantization_config": ignored})
    assert config is not None
    assert config.is_ignored("model.layers.3.mlp.down_proj")
    assert config.is_ignored("lm_head")
    assert not config.is_ignored("model.layers.13.mlp.down_proj")
    assert not config.is_ignored("model.layers.3.mlp.up_proj")


def test_compressed_tensors_channel_and_block() -> None:
    config = resolve_quant_config(None, {"quantization_config": CT_CHANNEL})
    assert config is not None
    assert (config.method, config.weight_scales, config.scale_name) == (
        "compressed-tensors",
        "channel",
        "weight_scale",
    )
    assert config.is_ignored("model.layers.0.mlp.gate")
    assert not config.is_ignored("model.layers.0.mlp.gate_proj")
    block = _with(CT_CHANNEL, _ct_group("weights", "strategy"), "block")
    block = _with(block, _ct_group("weights", "block_structure"), [128, 128])
    block = _with(block, _ct_group("input_activations", "strategy"), "group")
    block = _with(block, _ct_group("input_activations", "group_size"), 128)
    config = resolve_quant_config("compressed-tensors", {"quantization_config": block})
    assert config is not None and config.weight_scales == "block"


def test_quantize_on_load() -> None:
    assert resolve_quant_config(None, {}) is None
    config = resolve_quant_config("fp8", {})
    assert config == QuantConfig("fp8", "block", "weight_scale_inv", True, ())


BAD_CONFIGS = [
    pytest.param(
        "bitsandbytes",
        {},
        r"quantization: 'bitsandbytes' is not supported; supported: \['fp8'",
        id="arg",
    ),
    pytest.param("awq", {}, "'awq' describes a quantized checkpoint", id="awq-on-unquantized"),
    pytest.param(
        "compressed-tensors", {}, "no quantization_config; use 'fp8'", id="ct-on-unquantized"
    ),
    pytest.param("fp8", CT_CHANNEL, "does not match.*'compressed-tensors'", id="mismatch"),
    pytest.param(
        None,
        {"quant_method": "bitsandbytes"},
        r"quant_method: 'bitsandbytes' is not supported; supported: 'fp8'.*'gptq', 'awq'",
        id="unknown-method",
    ),
    pytest.param(
        None, {"quant_method": "gptq", "bits": 8}, "bits: 8 bits are not supported yet", id="gptq8"
    ),
    pytest.param(
        None,
        {**QWEN_FP8, "activation_scheme": "static"},
        "activation_scheme: 'static'.*not supported yet",
        id="static",
    ),
    pytest.param(
        None,
        {**QWEN_FP8, "weight_block_size": [64, 64]},
        r"weight_block_size: \[64, 64\] is not supported; supported: \[128, 128\]",
        id="block64",
    ),
    pytest.param(
        None,
        {k: v for k, v in QWEN_FP8.items() if k != "weight_block_size"},
        "weight_block_size: None.*per-tensor FP8",
        id="per-tensor",
    ),
    pytest.param(None, {**QWEN_FP8, "fmt": "e5m2"}, "fmt: 'e5m2'", id="e5m2"),
    pytest.param(
        None,
        _with(CT_CHANNEL, _ct_group("input_activations"), None),
        "input_activations: weight-only FP8",
        id="w8a16",
    ),
    pytest.param(
        None,
        _with(CT_CHANNEL, _ct_group("input_activations", "dynamic"), False),
        "input_activations.dynamic: static activation scales",
        id="ct-static",
    ),
    pytest.param(
        None,
        _with(CT_CHANNEL, _ct_group("weights", "type"), "int"),
        "weights: type 'int' with num_bits 8 is not supported",
        id="int8",
    ),
    pytest.param(
        None,
        _with(CT_CHANNEL, _ct_group("weights", "strategy"), "tensor"),
        "weights.strategy: 'tensor' is not supported",
        id="per-tensor-ct",
    ),
    pytest.param(
        None,
        _with(CT_CHANNEL, _ct_group("input_activations", "strategy"), "tensor"),
        "input_activations.strategy: 'tensor'.*supported: 'token'",
        id="ct-act-tensor",
    ),
    pytest.param(
        None,
        _with(CT_CHANNEL, ("format",), "pack-quantized"),
        "input_activations: quantized activations with int4 weights",
        id="packed-w4a8",
    ),
    pytest.param(
        None,
        _with(CT_CHANNEL, ("kv_cache_scheme",), {"num_bits": 8}),
        "kv_cache_scheme: an FP8 KV cache",
        id="kv-scheme",
    ),
]


@pytest.mark.parametrize(("quantization", "raw", "message"), BAD_CONFIGS)
def test_unsupported_configs_name_the_field(quantization, raw, message) -> None:
    hf_config = {"quantization_config": raw} if raw else {}
    with pytest.raises(ValueError, match=message):
        resolve_quant_config(quantization, hf_config)


def test_model_config_resolves_quantization(tiny_checkpoint, tmp_path) -> None:
    dense = ModelConfig(tiny_checkpoint("qwen3"), quantization="fp8")
    assert dense.quant_config is not None and dense.quant_config.quantize_on_load
    assert ModelConfig(tiny_checkpoint("qwen3")).quant_config is None
    assert ModelConfig(tiny_checkpoint("qwen3_moe"), quantization="fp8").quant_config is not None
    moe_channel = tmp_path / "moe_channel"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), moe_channel)
    with open(moe_channel / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = CT_CHANNEL
    with open(os.path.join(moe_channel, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(
        ValueError, match=r"FP8 mixture-of-experts models \(Qwen3MoeForCausalLM\) with channel"
    ):
        ModelConfig(str(moe_channel))


def test_quantization_flag(tiny_checkpoint) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    path = tiny_checkpoint("qwen3")
    args = EngineArgs.from_cli_args(parser.parse_args([path, "--quantization", "fp8"]), path)
    assert args.quantization == "fp8"
    config = args.replace(device="cpu").create_engine_config().model_config
    assert config.quant_config is not None and config.quant_config.method == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args([path, "--quantization", "bitsandbytes"])


def test_int4_formats_and_vllms_marlin_names() -> None:
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False}
    config = resolve_quant_config("gptq_marlin", {"quantization_config": gptq})
    assert config is not None and config.method == "gptq" and config.weight_scales == "int4"
    assert config.int4 is not None and (config.int4.group_size, config.int4.act_order) == (64, True)
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM"}
    config = resolve_quant_config(
        "awq_marlin", {"quantization_config": {**awq, "zero_point": True}}
    )
    assert config is not None and config.int4 is not None and config.int4.layout == "awq"


def test_awq_skips_modules_whose_name_contains_an_entry() -> None:
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    awq["modules_to_not_convert"] = ["layers.0.mlp", "visual"]
    config = resolve_quant_config(None, {"quantization_config": awq})
    assert config is not None
    assert config.is_ignored("model.layers.0.mlp.down_proj")
    assert config.is_ignored("model.visual.blocks.0.attn.qkv")
    assert not config.is_ignored("model.layers.1.mlp.down_proj")
