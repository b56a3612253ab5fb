"""Tuned fused-MoE tile configs: file format, bucket choice, fallback to the defaults."""

from __future__ import annotations

import json

import pytest

from ferrum.kernels import fused_moe_config as cfg

GROUPED = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
SMALL = {
    "GATE_UP_BLOCK_N": 8,
    "GATE_UP_BLOCK_K": 128,
    "DOWN_BLOCK_E": 1,
    "DOWN_SPLIT": 0,
    "DOWN_BLOCK_N": 4,
    "DOWN_BLOCK_K": 1024,
    "num_warps": 8,
    "num_stages": 2,
}


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(cfg, "CONFIG_DIR", tmp_path)
    cfg.load_tuned.cache_clear()
    yield tmp_path
    cfg.load_tuned.cache_clear()


def test_pick_takes_the_smallest_covering_bucket() -> None:
    buckets = {4: {"a": 1}, 64: {"a": 2}}
    assert [cfg.pick(buckets, n)["a"] for n in (1, 4, 5, 64, 65, 10_000)] == [1, 1, 2, 2, 2, 2]


def test_defaults_without_a_file(config_dir) -> None:
    grouped, small = cfg.get_configs(3, 128, 768, 2048, "Some GPU")
    assert grouped == cfg.pick(cfg.DEFAULT_GROUPED, 3)
    assert small == cfg.pick(cfg.DEFAULT_SMALL, 3)
    assert cfg.get_configs(3, 128, 768, 2048, None) == (grouped, small)  # the CPU


def test_saved_sections_are_used_and_kept(config_dir) -> None:
    cfg.save_section(128, 768, 2048, "NVIDIA H100 80GB HBM3", "grouped", {64: GROUPED}, config_dir)
    path = cfg.save_section(128, 768, 2048, "NVIDIA H100 80GB HBM3", "small", {1: SMALL})
    assert path.name == "E128_I768_H2048_NVIDIA_H100_80GB_HBM3.json"
    assert set(json.loads(path.read_text())) == {"grouped", "small"}
    grouped, small = cfg.get_configs(20, 128, 768, 2048, "NVIDIA H100 80GB HBM3")
    assert grouped == GROUPED and small == SMALL
    # Another shape or device has no file: defaults.
    assert cfg.get_configs(20, 64, 768, 2048, "NVIDIA H100 80GB HBM3")[0] != GROUPED


def test_a_file_with_one_section_falls_back_for_the_other(config_dir) -> None:
    cfg.save_section(8, 16, 32, "GPU", "small", {8: SMALL}, config_dir)
    grouped, small = cfg.get_configs(2, 8, 16, 32, "GPU")
    assert small == SMALL and grouped == cfg.pick(cfg.DEFAULT_GROUPED, 2)


@pytest.mark.parametrize(("key", "meaning"), [("DOWN_BLOCK_E", 1), ("DOWN_SPLIT", 0)])
def test_a_small_section_without_an_optional_key_reads_its_old_meaning(
    config_dir, key, meaning
) -> None:
    # Files written before DOWN_BLOCK_E existed: one expert choice a down tile; before
    # DOWN_SPLIT, one program summed all of a token's choices.
    old = {k: v for k, v in SMALL.items() if k != key}
    cfg.config_path(8, 16, 32, "GPU").write_text(json.dumps({"small": {"8": old}}))
    assert cfg.get_configs(2, 8, 16, 32, "GPU")[1] == old | {key: meaning}


def test_fp8_experts_have_their_own_file(config_dir) -> None:
    """FP8 sections override the shape's file section by section; bf16 never reads them."""
    cfg.save_section(8, 256, 128, "GPU", "grouped", {64: GROUPED}, config_dir)
    fp8_small = SMALL | {"DOWN_BLOCK_K": 256}
    path = cfg.save_section(8, 256, 128, "GPU", "small", {1: fp8_small}, config_dir, fp8=True)
    assert path.name == "E8_I256_H128_fp8_GPU.json"
    assert cfg.get_configs(1, 8, 256, 128, "GPU", fp8=True) == (GROUPED, fp8_small)
    assert cfg.get_configs(1, 8, 256, 128, "GPU")[1] == cfg.pick(cfg.DEFAULT_SMALL, 1)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ({"grouped": {}}, "non-empty"),
        ({"other": {"1": GROUPED}}, "sections"),
        ({"grouped": {"x": GROUPED}}, "positive token count"),
        ({"grouped": {"16": {"BLOCK_M": 16}}}, "exactly the keys"),
        ({"grouped": {"16": dict(GROUPED, BLOCK_N=0)}}, "positive integers"),
        ({"grouped": {"16": dict(GROUPED, num_stages=True)}}, "positive integers"),
        ({"grouped": {"16": dict(GROUPED, BLOCK_N=48)}}, "BLOCK_N must be a power of two"),
        ({"grouped": {"16": dict(GROUPED, BLOCK_M=8)}}, "BLOCK_M must be >= 16"),
        ({"small": {"1": dict(SMALL, num_warps=6)}}, "num_warps must be a power of two"),
        ({"small": {"1": dict(SMALL, DOWN_SPLIT=2)}}, "must be 0 or 1"),
        ({"small": {"1": dict(SMALL, DOWN_SPLIT=1, DOWN_BLOCK_E=8)}}, "DOWN_BLOCK_E must be 1"),
        ({"small": {"1": dict(SMALL, DOWN_BLOCK_N=0)}}, "positive integers"),
    ],
)
def test_bad_files_name_the_problem(config_dir, content, match: str) -> None:
    cfg.config_path(8, 16, 32, "GPU").write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match):
        cfg.get_configs(1, 8, 16, 32, "GPU")


def test_save_rejects_a_bad_config(config_dir) -> None:
    with pytest.raises(ValueError, match="exactly the keys"):
        cfg.save_section(8, 16, 32, "GPU", "small", {1: GROUPED}, config_dir)


def test_the_shipped_files_parse() -> None:
    cfg.load_tuned.cache_clear()
    files = sorted(cfg.CONFIG_DIR.glob("*.json"))
    assert files, "the Qwen3-30B-A3B H100 file ships with the package"
    tuned = cfg.load_tuned(128, 768, 2048, "NVIDIA H100 80GB HBM3")
    assert set(tuned) == {"grouped", "small"}
