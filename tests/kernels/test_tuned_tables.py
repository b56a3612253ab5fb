"""The order tiles are looked up in (kernels/tuned_tables): the user's folder for this GPU beats
the packaged table, which beats the device's rule; the CPU keeps the fixed defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrum.kernels import fp8_gemm_config, fused_moe_config, gemv_config
from ferrum.kernels.device_properties import H100, L40S
from ferrum.kernels.fp8_gemm_config import DEFAULT_BUCKETS, Fp8GemmConfig, save_buckets
from ferrum.kernels.fp8_gemm_rule import fp8_gemm_buckets, fp8_gemm_rule
from ferrum.kernels.fused_moe_config import DEFAULT_GROUPED, DEFAULT_SMALL, pick, save_section
from ferrum.kernels.fused_moe_rule import grouped_rule, moe_configs, small_rule
from ferrum.kernels.gemv_config import GemvTile, gemv_tile, save_gemv_tiles
from ferrum.kernels.tile_rules import gemv_tile_rule
from ferrum.kernels.tuned_tables import set_user_config_dir, tables_ignored, user_config_dir


@pytest.fixture
def folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """(package folder, user folder): empty table folders standing in for the package's and a
    user's; the process's user folder is restored and the table caches emptied after."""
    package, user = tmp_path / "package", tmp_path / "user"
    for module in (fp8_gemm_config, fused_moe_config, gemv_config):
        monkeypatch.setattr(module, "CONFIG_DIR", package / module.CONFIG_DIR.name)
    before = user_config_dir()
    set_user_config_dir(user)
    caches = (
        fp8_gemm_config.load_tuned_buckets,
        fused_moe_config.load_tuned,
        gemv_config.get_gemv_tiles,
    )
    for cache in caches:
        cache.cache_clear()
    yield package, user
    set_user_config_dir(before)
    for cache in caches:
        cache.cache_clear()


def _clear() -> None:
    fp8_gemm_config.load_tuned_buckets.cache_clear()
    fused_moe_config.load_tuned.cache_clear()
    gemv_config.get_gemv_tiles.cache_clear()


def test_fp8_gemm_user_table_beats_package_beats_rule(folders) -> None:
    package, user = folders
    shape = ("block", 256, 512)
    assert fp8_gemm_buckets(*shape, H100) == fp8_gemm_rule(*shape, H100)
    assert fp8_gemm_buckets(*shape, None) is DEFAULT_BUCKETS["block"]  # the CPU
    shipped = {64: Fp8GemmConfig(BLOCK_M=16), 1 << 62: Fp8GemmConfig()}
    save_buckets(*shape, H100.name, shipped, package / "fp8_gemm_configs")
    _clear()
    assert fp8_gemm_buckets(*shape, H100) == shipped
    assert fp8_gemm_buckets(*shape, L40S) == fp8_gemm_rule(*shape, L40S)  # another GPU
    mine = {1 << 62: Fp8GemmConfig(BLOCK_M=32, SPLIT_K=2)}
    save_buckets(*shape, H100.name, mine, user / "fp8_gemm_configs")
    _clear()
    assert fp8_gemm_buckets(*shape, H100) == mine
    set_user_config_dir(None)  # a process told to read no user folder
    assert fp8_gemm_buckets(*shape, H100) == shipped


def test_moe_sections_come_from_the_user_then_the_package_then_the_rule(folders) -> None:
    package, user = folders
    shape = (8, 128, 256)
    # The rule as a table: 20 tokens take the 32-token bucket, the small path's largest (8).
    expected_rule = (grouped_rule(32, *shape, 2, H100), small_rule(8, *shape, 2, H100))
    assert moe_configs(20, *shape, 2, H100) == expected_rule
    assert moe_configs(20, *shape, 2, None) == (pick(DEFAULT_GROUPED, 20), pick(DEFAULT_SMALL, 20))
    shipped = {64: {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}}
    save_section(*shape, H100.name, "grouped", shipped, package / "fused_moe_configs")
    _clear()
    assert moe_configs(20, *shape, 2, H100) == (shipped[64], expected_rule[1])
    mine = {8: dict(shipped[64], BLOCK_N=64)}
    small = {8: dict(DEFAULT_SMALL[2], GATE_UP_BLOCK_N=32)}
    save_section(*shape, H100.name, "grouped", mine, user / "fused_moe_configs")
    save_section(*shape, H100.name, "small", small, user / "fused_moe_configs")
    _clear()
    assert moe_configs(20, *shape, 2, H100) == (mine[8], small[8])
    # FP8 experts read their own file first, then the file of 16-bit experts.
    fp8_small = {8: dict(small[8], GATE_UP_BLOCK_N=8)}
    save_section(*shape, H100.name, "small", fp8_small, package / "fused_moe_configs", fp8=True)
    _clear()
    assert moe_configs(20, *shape, 2, H100, fp8=True) == (mine[8], fp8_small[8])


def test_gemv_user_entry_beats_package_entry_beats_rule(folders) -> None:
    package, user = folders
    assert gemv_tile(256, 512, H100) == GemvTile(*gemv_tile_rule(256, 512, H100))
    shipped = {(256, 512): GemvTile(8, 256), (128, 512): GemvTile(2, 512)}
    save_gemv_tiles(H100.name, shipped, package / "gemv_configs", drop=frozenset({(64, 512)}))
    _clear()
    assert gemv_tile(256, 512, H100) == GemvTile(8, 256)
    assert gemv_tile(64, 512, H100) is None  # measured slower than cuBLAS: F.linear
    save_gemv_tiles(H100.name, {(256, 512): GemvTile(1, 512)}, user / "gemv_configs")
    _clear()
    assert gemv_tile(256, 512, H100) == GemvTile(1, 512)
    assert gemv_tile(128, 512, H100) == GemvTile(2, 512)  # the package's, for shapes the user's
    assert gemv_tile(96, 512, H100) == GemvTile(*gemv_tile_rule(96, 512, H100))  # file omits


def test_the_debug_switch_ignores_every_table(folders, monkeypatch) -> None:
    package, user = folders
    save_buckets("block", 256, 512, H100.name, {1: Fp8GemmConfig()}, user / "fp8_gemm_configs")
    save_gemv_tiles(H100.name, {(256, 512): None}, package / "gemv_configs")
    grouped = {64: {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}}
    save_section(8, 128, 256, H100.name, "grouped", grouped, user / "fused_moe_configs")
    _clear()
    assert gemv_tile(256, 512, H100) is None
    monkeypatch.setenv("FERRUM_DEBUG_IGNORE_TUNED_TABLES", "1")
    tables_ignored.cache_clear()
    try:
        assert fp8_gemm_buckets("block", 256, 512, H100) == fp8_gemm_rule("block", 256, 512, H100)
        assert gemv_tile(256, 512, H100) == GemvTile(*gemv_tile_rule(256, 512, H100))
        assert moe_configs(64, 8, 128, 256, 2, H100)[0] == grouped_rule(64, 8, 128, 256, 2, H100)
    finally:
        monkeypatch.delenv("FERRUM_DEBUG_IGNORE_TUNED_TABLES")
        tables_ignored.cache_clear()
