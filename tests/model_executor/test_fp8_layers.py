"""FP8 linear layers in the models: which layers are quantized, their parameters, dummy FP8
weights, and checkpoints that do not match their quantization_config (clear errors, never a
silent wrong load). Logits against transformers: tests/hf_equivalence/test_fp8_checkpoints.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ferrum.config import ModelConfig
from ferrum.kernels.fp8_weight import dequantize_weight_block
from ferrum.model_executor.layers.linear import Linear
from ferrum.model_executor.layers.quantization.dense import DenseLinearMethod
from ferrum.model_executor.model_loader import load_model
from tests.utils.fp8_checkpoints import write_fp8_checkpoint
from tests.utils.model_step import CPU, load

FP8 = torch.float8_e4m3fn
FP8_SHAPES = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 64}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _linears(model: torch.nn.Module) -> dict[str, Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def _set_quantization_config(path: str, quantization_config: dict) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(config_path, "w") as f:
        json.dump(config, f)


def test_quantize_on_load_covers_every_projection_and_nothing_else(tiny_checkpoint) -> None:
    source = tiny_checkpoint("qwen3", **FP8_SHAPES)
    _, plain = load(source)
    _, model = load(source, quantization="fp8")
    plain_params = dict(plain.named_parameters())
    linears = _linears(model)
    assert {name.rsplit(".", 1)[1] for name in linears} == set(PROJECTIONS)
    for name, layer in linears.items():
        assert layer.weight.dtype == FP8, name
        scale = layer.weight_scale_inv
        n, k = layer.weight.shape
        assert scale.shape == (-(-n // 128), k // 128) and scale.dtype == torch.float32
        original = plain_params[f"{name}.weight"]
        restored = dequantize_weight_block(layer.weight, scale)
        # Round to nearest e4m3: error <= half a step, 2^-4 of the value at most (normal codes),
        # and subnormal steps are 2^-9 of the block scale.
        bound = (
            original.abs() * 2.0**-4
            + scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1) * 2.0**-9
        )
        assert torch.all((restored - original).abs() <= bound), name
    for name, param in model.named_parameters():
        if not name.endswith(("_proj.weight", "weight_scale_inv")):
            assert param.dtype == torch.float32, name
            torch.testing.assert_close(param, plain_params[name], atol=0, rtol=0)


def test_modules_to_not_convert_stay_in_the_model_dtype(tiny_checkpoint, tmp_path) -> None:
    source = tiny_checkpoint("llama", **FP8_SHAPES)
    kept = ("model.layers.1.mlp.down_proj",)
    fp8_dir = write_fp8_checkpoint(source, str(tmp_path / "fp8"), "fp8", ignore=kept)
    _, model = load(fp8_dir)
    down = model.model.layers[1].mlp.down_proj
    assert isinstance(down.quant_method, DenseLinearMethod) and down.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8


def test_fused_layer_partly_ignored_is_refused(tiny_checkpoint, tmp_path) -> None:
    source = tiny_checkpoint("qwen3", **FP8_SHAPES)
    kept = ("model.layers.0.self_attn.q_proj",)
    fp8_dir = write_fp8_checkpoint(source, str(tmp_path / "fp8"), "fp8", ignore=kept)
    with pytest.raises(ValueError, match=r"are fused into one layer, but only .*q_proj"):
        load(fp8_dir)


def test_checkpoint_that_contradicts_its_config_fails(tiny_checkpoint, tmp_path) -> None:
    source = tiny_checkpoint("qwen3", **FP8_SHAPES)
    # The ignore list says down_proj is bf16, but the checkpoint stores it in FP8.
    fp8_dir = write_fp8_checkpoint(source, str(tmp_path / "fp8"), "fp8")
    _set_quantization_config(
        fp8_dir,
        {
            "quant_method": "fp8",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": ["down_proj"],
        },
    )
    with pytest.raises(ValueError, match="float8_e4m3fn for a float32 parameter|no model param"):
        load(fp8_dir)
    # A config that says FP8 over an unquantized checkpoint.
    unquantized = tmp_path / "unquantized"
    unquantized.mkdir()
    for name in os.listdir(source):
        if name != "config.json":
            os.symlink(os.path.join(source, name), unquantized / name)
    with open(os.path.join(source, "config.json")) as f:
        (unquantized / "config.json").write_text(f.read())
    _set_quantization_config(
        str(unquantized), {"quant_method": "fp8", "weight_block_size": [128, 128]}
    )
    with pytest.raises(ValueError, match="float32 for a float8_e4m3fn parameter"):
        load(str(unquantized))


def test_merged_shards_off_the_scale_blocks_are_refused(tiny_checkpoint, tmp_path) -> None:
    # head_dim 32: q 128 rows, k 64, v 64, so v starts at row 192, inside scale block 1.
    source = tiny_checkpoint("qwen3", hidden_size=128, intermediate_size=256, head_dim=32)
    fp8_dir = write_fp8_checkpoint(source, str(tmp_path / "fp8"), "fp8")
    with pytest.raises(ValueError, match=r"shard 'v' starts at output row 192, inside a 128-row"):
        load(fp8_dir)


def test_input_size_must_be_a_multiple_of_128(tiny_checkpoint) -> None:
    with pytest.raises(
        ValueError, match=r"FP8 layer model\.layers\.0\.self_attn\.q_proj/.*multiple of 128.*got 64"
    ):
        load(tiny_checkpoint("qwen3"), quantization="fp8")


@pytest.mark.parametrize("fmt", ["fp8", "compressed-tensors", "on-load"])
def test_dummy_fp8_weights(tiny_checkpoint, tmp_path, fmt) -> None:
    """Dummy weights in each FP8 format: fp8 codes whose dequantized values have the dummy std
    (0.02), deterministic from the seed, with the scales' shapes."""
    source = tiny_checkpoint("qwen3", **FP8_SHAPES)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    if fmt == "on-load":
        with open(os.path.join(source, "config.json")) as f:
            (config_only / "config.json").write_text(f.read())
        quantization = "fp8"
    else:
        fp8_dir = write_fp8_checkpoint(source, str(tmp_path / "fp8"), fmt)
        with open(os.path.join(fp8_dir, "config.json")) as f:
            (config_only / "config.json").write_text(f.read())
        quantization = None

    def dummy(seed: int) -> torch.nn.Module:
        config = ModelConfig(
            str(config_only), load_format="dummy", seed=seed, quantization=quantization
        )
        return load_model(config, CPU)

    first, again = dummy(1), dummy(1)
    scale_name = "weight_scale" if fmt == "compressed-tensors" else "weight_scale_inv"
    for (name, layer), other in zip(_linears(first).items(), _linears(again).values()):
        scale = getattr(layer, scale_name)
        assert torch.equal(layer.weight.view(torch.uint8), other.weight.view(torch.uint8)), name
        assert torch.equal(scale, getattr(other, scale_name)), name
        n, k = layer.weight.shape
        if fmt == "compressed-tensors":
            assert scale.shape == (n, 1)
            values = layer.weight.float() * scale
        else:
            assert scale.shape == (-(-n // 128), k // 128)
            values = dequantize_weight_block(layer.weight, scale)
        assert 0.015 < values.std().item() < 0.025, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_dummy_fp8_experts(tiny_checkpoint, tmp_path, quantization, dtype) -> None:
    """FP8 MoE experts from Qwen's FP8 config (None) or quantized on load ("fp8"): fp8 stacked
    experts with one fp32 scale per 128x128 block whatever the model dtype, dequantizing to the
    dummy std; the router stays in the model dtype."""
    shapes = {**FP8_SHAPES, "moe_intermediate_size": 128}
    source = tiny_checkpoint("qwen3_moe", **shapes)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    with open(os.path.join(source, "config.json")) as f:
        (config_only / "config.json").write_text(f.read())
    if quantization is None:
        _set_quantization_config(
            str(config_only),
            {
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "activation_scheme": "dynamic",
            },
        )
    config = ModelConfig(
        str(config_only),
        load_format="dummy",
        seed=3,
        quantization=quantization,
        dtype=str(dtype).removeprefix("torch."),
    )
    model = load_model(config, CPU)
    block = model.model.layers[0].mlp
    assert block.gate.weight.dtype == dtype
    assert isinstance(block.gate.quant_method, DenseLinearMethod)
    experts = block.experts
    assert experts.w13.dtype == FP8 and experts.w13_scale.shape == (8, 2, 1)
    assert experts.w2.dtype == FP8 and experts.w2_scale.shape == (8, 1, 1)
    assert experts.w13_scale.dtype == experts.w2_scale.dtype == torch.float32
    values = experts.w13.float() * experts.w13_scale.repeat_interleave(128, 1).repeat_interleave(
        128, 2
    )
    assert 0.015 < values.std().item() < 0.025
