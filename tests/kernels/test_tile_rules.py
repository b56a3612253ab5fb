"""The default tile rules on fake devices (device_properties.KNOWN_DEVICES): every tile fits the
device's shared memory, makes at least a wave of programs or splits K as far as it may, uses the
Hopper-only paths only on Hopper, and reproduces the H100 tables' choices within this pattern:
GEMMs the same path and rows a tile, columns and programs within a factor of two; GEMVs rows and
K tile each within a factor of four (the tables' GEMV tiles vary that much between shapes)."""

from __future__ import annotations

import json

import pytest

from ferrum.kernels.device_properties import A100, H100, H200, KNOWN_DEVICES, L40S, RTX_4090
from ferrum.kernels.fp8_gemm_config import CONFIG_DIR, SCALE_BLOCK, Fp8GemmConfig, parse_buckets
from ferrum.kernels.fp8_gemm_rule import RULE_BUCKETS, bucket_rule, fp8_gemm_rule
from ferrum.kernels.fused_moe_config import CONFIG_DIR as MOE_DIR
from ferrum.kernels.fused_moe_rule import grouped_rule, rule_buckets, small_rule
from ferrum.kernels.gemv_config import CONFIG_DIR as GEMV_DIR
from ferrum.kernels.gemv_config import parse_tiles
from ferrum.kernels.tile_rules import (
    MAX_SPLIT_K,
    MIN_STEPS_PER_SPLIT,
    SMEM_RESERVE,
    cdiv,
    gemv_tile_rule,
)

DEVICES = list(KNOWN_DEVICES.values())
DEVICE_IDS = [d.name.split()[-1] for d in DEVICES]
# Qwen3-8B (qkv, o, gate_up, down), Qwen3-30B-A3B's attention, odd and tiny shapes.
SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (5120, 2048), (128, 256)]
# Buckets where the table took 64-row Triton tiles at 16 rows (the rule keeps 16-row tiles).
HEIGHT_DEVIATIONS = {("channel", 24576, 4096, 16)}


def _programs(config: Fp8GemmConfig, m: int, n: int) -> int:
    return cdiv(m, config.BLOCK_M) * cdiv(n, config.BLOCK_N) * config.SPLIT_K


def _h100_tables() -> list[tuple[str, int, int, dict[int, Fp8GemmConfig]]]:
    tables = []
    for path in sorted(CONFIG_DIR.glob("*_NVIDIA_H100_80GB_HBM3.json")):
        fmt, n, k = path.name.split("_")[:3]
        buckets = parse_buckets(json.loads(path.read_text()), str(path))
        tables.append((fmt, int(n[1:]), int(k[1:]), buckets))
    assert tables
    return tables


@pytest.mark.parametrize("device", DEVICES, ids=DEVICE_IDS)
@pytest.mark.parametrize("scale_format", ["block", "channel"])
def test_fp8_gemm_tiles_fit_and_fill_the_device(device, scale_format) -> None:
    for n, k in SHAPES:
        for m, config in fp8_gemm_rule(scale_format, n, k, device).items():
            where = f"{device.name} {scale_format} N{n} K{k} M<={m}: {config}"
            if config.backend == "gemv":
                assert m == 1 and (cdiv(n, config.BLOCK_N) >= 2 * device.num_sms or
                                   config.BLOCK_N == 1), where  # fmt: skip
                continue
            if config.backend == "wgmma":
                assert device.is_hopper and scale_format == "block", where
            if config.backend == "scaled_mm":
                assert device.is_hopper if scale_format == "block" else device.capability >= (8, 9)
            stage = (config.BLOCK_M + config.BLOCK_N) * SCALE_BLOCK
            assert stage * config.num_stages <= device.shared_memory_per_block - SMEM_RESERVE, where
            if config.backend == "triton" and m < 1 << 62:
                rows = min(m, 256)
                split_capped = config.SPLIT_K * 2 > MAX_SPLIT_K or (
                    cdiv(k, SCALE_BLOCK) // (config.SPLIT_K * 2) < MIN_STEPS_PER_SPLIT
                )
                fills = _programs(config, rows, n) >= device.num_sms
                assert fills or split_capped, where


def test_fp8_gemm_rule_reproduces_the_h100_tables() -> None:
    for fmt, n, k, table in _h100_tables():
        for m, tuned in table.items():
            rule = (
                bucket_rule(fmt, n, k, m, H100)
                if m < 1 << 62
                else fp8_gemm_rule(fmt, n, k, H100)[1 << 62]
            )
            where = f"{fmt} N{n} K{k} M<={m}: table {tuned}, rule {rule}"
            assert rule.backend == tuned.backend, where
            if rule.backend == "gemv":
                assert tuned.BLOCK_N // 4 <= rule.BLOCK_N <= tuned.BLOCK_N * 4, where
                assert tuned.BLOCK_K // 4 <= rule.BLOCK_K <= tuned.BLOCK_K * 4, where
                continue
            if rule.backend == "scaled_mm":
                continue  # cuBLASLt's own tiles; the fields serve only where it refuses
            if (fmt, n, k, m) not in HEIGHT_DEVIATIONS:
                assert rule.BLOCK_M == tuned.BLOCK_M, where
            assert tuned.BLOCK_N // 2 <= rule.BLOCK_N <= tuned.BLOCK_N * 2, where
            rows = min(m, 4096)
            programs, tuned_programs = _programs(rule, rows, n), _programs(tuned, rows, n)
            assert tuned_programs // 2 <= programs <= tuned_programs * 2, where


def test_wgmma_stages_follow_the_waves_as_the_h100_and_h200_tables_do() -> None:
    """Where a shipped table (either GPU) and the rule both take a wgmma tile of the same width,
    the rule takes the table's 4 stages when the tiles make more than a wave, and 6 or more
    (the tables' 6-8) when they make one."""
    compared = 0
    for device in (H100, H200):
        for path in sorted(CONFIG_DIR.glob(f"block_*_{device.name.replace(' ', '_')}.json")):
            n, k = (int(part[1:]) for part in path.name.split("_")[1:3])
            for m, tuned in parse_buckets(json.loads(path.read_text()), str(path)).items():
                rule = bucket_rule("block", n, k, m, device) if m < 1 << 62 else None
                if tuned.backend != "wgmma" or rule is None or rule.backend != "wgmma":
                    continue
                if rule.BLOCK_N != tuned.BLOCK_N:
                    continue
                waves = cdiv(m, 64) * cdiv(n, rule.BLOCK_N) / device.num_sms
                where = f"{device.name} N{n} K{k} M<={m} ({waves:.2f} waves): {tuned} / {rule}"
                if waves > 1:
                    assert rule.num_stages == tuned.num_stages == 4, where
                    assert rule.UNROLL == tuned.UNROLL == 2, where
                else:
                    assert rule.num_stages >= 5 and tuned.num_stages >= 6, where
                compared += 1
    assert compared >= 20


def test_small_shared_memory_gpus_take_fewer_stages_and_no_hopper_paths() -> None:
    for device in (L40S, RTX_4090, A100):
        for m in RULE_BUCKETS:
            config = bucket_rule("block", 4096, 4096, m, device)
            assert config.backend in ("gemv", "triton"), (device.name, m, config)
    big_h100 = fp8_gemm_rule("block", 4096, 4096, H100)[1 << 62]
    big_l40s = fp8_gemm_rule("block", 4096, 4096, L40S)[1 << 62]
    assert big_l40s.num_stages < big_h100.num_stages
    # sm89 has FP8 tensor cores: cuBLASLt's row-wise scaled GEMM; sm80 has none.
    assert fp8_gemm_rule("channel", 4096, 4096, L40S)[1 << 62].backend == "scaled_mm"
    assert fp8_gemm_rule("channel", 4096, 4096, A100)[1 << 62].backend == "triton"
    # Fewer SMs want fewer splits for the same tiles.
    assert bucket_rule("block", 4096, 4096, 16, A100).SPLIT_K >= 2


def test_moe_grouped_rule_reproduces_the_h100_table_and_fits() -> None:
    data = json.loads((MOE_DIR / "E128_I768_H2048_NVIDIA_H100_80GB_HBM3.json").read_text())
    for bound, tuned in data["grouped"].items():
        rule = grouped_rule(int(bound), 128, 768, 2048, 8, H100)
        where = f"T<={bound}: table {tuned}, rule {rule}"
        assert rule["BLOCK_M"] == tuned["BLOCK_M"] and rule["BLOCK_K"] == tuned["BLOCK_K"], where
        assert tuned["BLOCK_N"] // 2 <= rule["BLOCK_N"] <= tuned["BLOCK_N"] * 2, where
    for device in DEVICES:
        for fp8 in (False, True):
            for t, c in rule_buckets("grouped", 128, 768, 2048, 8, device, fp8).items():
                stage = c["BLOCK_K"] * (2 * c["BLOCK_M"] + (1 if fp8 else 2) * c["BLOCK_N"])
                assert stage * c["num_stages"] <= device.shared_memory_per_block, (device, t, c)


@pytest.mark.parametrize("fp8", [False, True])
def test_moe_small_rule_reproduces_the_h100_table(fp8) -> None:
    name = f"E128_I768_H2048{'_fp8' if fp8 else ''}_NVIDIA_H100_80GB_HBM3.json"
    for bound, tuned in json.loads((MOE_DIR / name).read_text())["small"].items():
        rule = small_rule(int(bound), 128, 768, 2048, 8, H100, fp8)
        where = f"T<={bound}: table {tuned}, rule {rule}"
        assert rule["DOWN_SPLIT"] == tuned.get("DOWN_SPLIT", 0), where
        assert rule["DOWN_BLOCK_E"] == tuned["DOWN_BLOCK_E"], where
        assert rule["num_warps"] == tuned["num_warps"], where
        for key in ("GATE_UP_BLOCK_N", "DOWN_BLOCK_N", "GATE_UP_BLOCK_K", "DOWN_BLOCK_K"):
            assert tuned[key] // 2 <= rule[key] <= tuned[key] * 2, (key, where)


def test_moe_small_rule_widens_with_fewer_sms() -> None:
    few_sms = small_rule(1, 128, 768, 2048, 8, A100)
    assert few_sms["GATE_UP_BLOCK_N"] >= small_rule(1, 128, 768, 2048, 8, H100)["GATE_UP_BLOCK_N"]


def test_gemv_rule_reproduces_the_h100_table() -> None:
    path = GEMV_DIR / "NVIDIA_H100_80GB_HBM3.json"
    for (n, k), tuned in parse_tiles(json.loads(path.read_text()), str(path)).items():
        assert tuned is not None
        block_n, block_k, num_warps, num_stages = gemv_tile_rule(n, k, H100)
        where = f"N{n} K{k}: table {tuned}, rule {(block_n, block_k)}"
        assert tuned.BLOCK_N // 4 <= block_n <= tuned.BLOCK_N * 4, where
        assert tuned.BLOCK_K // 2 <= block_k <= tuned.BLOCK_K * 2, where
        assert k % block_k == 0 or block_k == 128, where
