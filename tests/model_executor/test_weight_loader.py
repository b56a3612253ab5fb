"""Checkpoint reading: sharded and single-file safetensors, stacked MoE experts, dtype
conversion, and the errors for missing / corrupt files, missing tensors and shape mismatches."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferrum.config import ModelConfig
from ferrum.model_executor.model_loader import load_model
from ferrum.model_executor.weight_loader import INDEX_FILE, list_safetensors_files

CPU = torch.device("cpu")


def load(path: str, dtype: str = "auto") -> torch.nn.Module:
    return load_model(ModelConfig(str(path), dtype=dtype), CPU)


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
    assert params_a.keys() == params_b.keys()
    for name, param in params_a.items():
        assert torch.equal(param, params_b[name]), name


def single_file_copy(source: str, dest: os.PathLike[str]) -> str:
    """A copy of a single-file checkpoint whose tensors the test may rewrite."""
    folder = shutil.copytree(source, dest)
    assert os.listdir(folder).count("model.safetensors") == 1
    return str(folder)


def rewrite(folder: str, edit) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_sharded_and_single_file_load_the_same(tiny_checkpoint) -> None:
    sharded = tiny_checkpoint("llama")
    single = tiny_checkpoint("llama", max_shard_size="1GB")
    assert os.path.isfile(os.path.join(sharded, INDEX_FILE))
    assert len(list_safetensors_files(sharded)) > 2
    assert list_safetensors_files(single) == [os.path.join(single, "model.safetensors")]
    assert_same_params(load(sharded), load(single))


def test_weights_convert_to_model_dtype(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    fp32, bf16 = load(path), load(path, dtype="bfloat16")
    for (name, p32), (_, p16) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert p16.dtype == torch.bfloat16, name
        assert torch.equal(p16, p32.bfloat16()), name


def test_fused_qkv_and_gate_up_rows_follow_checkpoint(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen2")
    model = load(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    prefix = "model.layers.1."
    qkv = model.get_parameter(prefix + "self_attn.qkv_proj.weight")
    expected = [tensors[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]
    assert torch.equal(qkv, torch.cat(expected))
    qkv_bias = model.get_parameter(prefix + "self_attn.qkv_proj.bias")
    assert torch.equal(
        qkv_bias, torch.cat([tensors[prefix + f"self_attn.{p}_proj.bias"] for p in "qkv"])
    )
    gate_up = model.get_parameter(prefix + "mlp.gate_up_proj.weight")
    expected = [tensors[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(gate_up, torch.cat(expected))
    # Tied: one Parameter serves the embedding and the head.
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_moe_experts_stack_from_per_expert_and_fused_layouts(tiny_checkpoint, tmp_path) -> None:
    source = tiny_checkpoint("qwen3_moe")
    per_expert = load(source)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    w13 = per_expert.get_parameter("model.layers.2.mlp.experts.w13")
    w2 = per_expert.get_parameter("model.layers.2.mlp.experts.w2")
    assert w13.shape == (8, 64, 64) and w2.shape == (8, 64, 32)
    expert = "model.layers.2.mlp.experts.5."
    assert torch.equal(w13[5, :32], tensors[expert + "gate_proj.weight"])
    assert torch.equal(w13[5, 32:], tensors[expert + "up_proj.weight"])
    assert torch.equal(w2[5], tensors[expert + "down_proj.weight"])
    # Layer 1 is in mlp_only_layers: a dense MLP.
    assert per_expert.get_parameter("model.layers.1.mlp.gate_up_proj.weight").shape == (192, 64)

    # transformers 5's stacked layout in memory: gate_up_proj [E, 2I, H], down_proj [E, H, I].
    fused = single_file_copy(source, tmp_path / "fused")
    pattern = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")

    def stack_experts(tensors: dict[str, torch.Tensor]) -> None:
        prefixes = {m.group(1) for m in map(pattern.match, tensors) if m}
        for prefix in prefixes:
            parts = {
                p: [tensors.pop(f"{prefix}.{e}.{p}_proj.weight") for e in range(8)]
                for p in ("gate", "up", "down")
            }
            gate_up = [torch.cat([g, u]) for g, u in zip(parts["gate"], parts["up"])]
            tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            tensors[f"{prefix}.down_proj"] = torch.stack(parts["down"])

    rewrite(fused, stack_experts)
    assert_same_params(per_expert, load(fused))


def test_missing_expert_tensor_is_reported(tiny_checkpoint, tmp_path) -> None:
    folder = single_file_copy(tiny_checkpoint("qwen3_moe"), tmp_path / "ckpt")
    rewrite(folder, lambda t: t.pop("model.layers.0.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.w13") as info:
        load(folder)
    assert "w2" not in str(info.value)


def test_missing_weight_file_in_index(tiny_checkpoint, tmp_path) -> None:
    folder = shutil.copytree(tiny_checkpoint("llama"), tmp_path / "ckpt")
    victim = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(folder, victim))
    with pytest.raises(
        ValueError, match=rf"weight file .*{victim} named in .*{INDEX_FILE} is missing"
    ):
        load(folder)


def test_folder_without_weights(tiny_checkpoint, tmp_path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    shutil.copy(os.path.join(tiny_checkpoint("qwen3"), "config.json"), folder)
    with pytest.raises(ValueError, match=r"no \*\.safetensors weight files in"):
        load(str(folder))


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_weight_file(tiny_checkpoint, tmp_path, damage) -> None:
    folder = single_file_copy(tiny_checkpoint("qwen3"), tmp_path / "ckpt")
    path = os.path.join(folder, "model.safetensors")
    if damage == "truncate":
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size // 2)
    else:
        with open(path, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not a json header")
    with pytest.raises(ValueError, match=r"model\.safetensors is corrupt or unreadable"):
        load(folder)


def test_missing_tensor_names_the_parameter(tiny_checkpoint, tmp_path) -> None:
    folder = single_file_copy(tiny_checkpoint("qwen3"), tmp_path / "ckpt")
    rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(
        ValueError, match=r"does not provide .*model\.layers\.1\.self_attn\.qkv_proj\.weight"
    ):
        load(folder)
    rewrite(folder, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load(folder)


@pytest.mark.parametrize(
    ("tensor", "shape", "expected"),
    [
        (
            "model.layers.0.mlp.down_proj.weight",
            (64, 95),
            "parameter 'model.layers.0.mlp.down_proj.weight': expected shape (64, 96), "
            "found (64, 95)",
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            (48, 64),
            "parameter 'model.layers.0.self_attn.qkv_proj.weight': expected shape (32, 64) "
            "for shard 'k', found (48, 64)",
        ),
    ],
)
def test_shape_mismatch_names_tensor_parameter_shapes_and_file(
    tiny_checkpoint, tmp_path, tensor, shape, expected
) -> None:
    folder = single_file_copy(tiny_checkpoint("qwen3"), tmp_path / "ckpt")
    rewrite(folder, lambda t: t.update({tensor: torch.zeros(shape)}))
    with pytest.raises(ValueError) as info:
        load(folder)
    message = str(info.value)
    assert f"checkpoint tensor {tensor!r}" in message
    assert expected in message
    assert message.endswith(f"(weight file {os.path.join(folder, 'model.safetensors')})")


def test_unexpected_tensor_is_rejected(tiny_checkpoint, tmp_path) -> None:
    folder = single_file_copy(tiny_checkpoint("qwen3"), tmp_path / "ckpt")
    rewrite(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.extra\.weight' matches no model parameter"
    ):
        load(folder)


def test_tied_checkpoint_may_carry_lm_head(tiny_checkpoint, tmp_path) -> None:
    folder = single_file_copy(tiny_checkpoint("qwen2"), tmp_path / "ckpt")
    rewrite(folder, lambda t: t.update({"lm_head.weight": torch.zeros(384, 64)}))
    model = load(folder)
    assert model.lm_head.weight.abs().sum() > 0


def test_large_checkpoints_show_loading_progress(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import save_file

    from ferrum.model_executor import weight_loader

    save_file({"w": torch.zeros(64, 64)}, str(tmp_path / "model.safetensors"))
    assert [name for name, _ in weight_loader.SafetensorsCheckpoint(str(tmp_path))] == ["w"]
    assert "Loading weights" not in capsys.readouterr().err  # small: no bar
    monkeypatch.setattr(weight_loader, "PROGRESS_MIN_BYTES", 1)
    assert [name for name, _ in weight_loader.SafetensorsCheckpoint(str(tmp_path))] == ["w"]
    assert "Loading weights: 100%" in capsys.readouterr().err
