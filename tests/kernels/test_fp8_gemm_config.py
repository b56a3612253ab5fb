from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferrum.kernels import fp8_gemm_config
from ferrum.kernels.fp8_gemm_config import (
    DEFAULT_BUCKETS,
    Fp8GemmConfig,
    get_fp8_gemm_buckets,
    load_tuned_buckets,
    parse_buckets,
    pick,
    save_buckets,
)


def test_pick_smallest_covering_bucket_else_largest() -> None:
    buckets = DEFAULT_BUCKETS["block"]
    assert pick(buckets, 1) is buckets[1] and pick(buckets, 2) is buckets[16]
    assert pick(buckets, 16) is buckets[16]
    assert pick(buckets, 17) is buckets[64]
    small = {8: Fp8GemmConfig(BLOCK_M=16), 32: Fp8GemmConfig(BLOCK_M=32)}
    assert pick(small, 1000).BLOCK_M == 32


def test_defaults_are_valid_for_their_format() -> None:
    # The Triton fallback tile of a block bucket steps K by one 128-column scale group; the
    # GEMV's rows share one scale row and its K steps cover whole groups.
    for fmt, buckets in DEFAULT_BUCKETS.items():
        assert buckets[1].backend == "gemv"
        assert all(c.backend == "scaled_mm" for m, c in buckets.items() if m > 1)
        if fmt == "block":
            assert all(c.BLOCK_K == 128 for m, c in buckets.items() if m > 1)
            assert 128 % buckets[1].BLOCK_N == 0 and buckets[1].BLOCK_K % 128 == 0
    assert set(DEFAULT_BUCKETS) == {"block", "channel"}


def test_save_then_load_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    buckets = {4: Fp8GemmConfig(quant="fused", BLOCK_M=16, BLOCK_N=32), 512: Fp8GemmConfig()}
    path = save_buckets("channel", 4096, 12288, "NVIDIA H100 80GB HBM3", buckets, tmp_path)
    assert path.name == "channel_N4096_K12288_NVIDIA_H100_80GB_HBM3.json"
    monkeypatch.setattr(fp8_gemm_config, "CONFIG_DIR", tmp_path)
    load_tuned_buckets.cache_clear()
    try:
        assert get_fp8_gemm_buckets("channel", 4096, 12288, "NVIDIA H100 80GB HBM3") == buckets
        assert (
            get_fp8_gemm_buckets("channel", 4096, 4096, "NVIDIA H100 80GB HBM3")
            is (DEFAULT_BUCKETS["channel"])
        )
        assert get_fp8_gemm_buckets("block", 4096, 12288, None) is DEFAULT_BUCKETS["block"]
    finally:
        load_tuned_buckets.cache_clear()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"backend": "cutlass"}, "backend"),
        ({"quant": "static"}, "quant"),
        ({"BLOCK_N": 48}, "BLOCK_N must be a power of two"),
        ({"num_stages": 0}, "num_stages must be a positive int"),
        ({"num_warps": 3}, "num_warps must be a power of two"),
        ({"SPLIT_K": 0}, "SPLIT_K must be a positive int"),
        ({"SPLIT_K": 2.0}, "SPLIT_K must be a positive int"),
        ({"SPLIT_K": 17}, "SPLIT_K must be <= 16"),
        ({"UNROLL": 0}, "UNROLL must be a positive int"),
        ({"backend": "wgmma", "BLOCK_M": 32}, "wgmma GEMM needs BLOCK_M 64 or 128"),
        ({"backend": "wgmma", "BLOCK_N": 256}, "wgmma GEMM needs BLOCK_M 64 or 128, BLOCK_N"),
        ({"backend": "wgmma", "num_warps": 2}, "and 4 or 8 warps"),
        ({"backend": "wgmma", "UNROLL": 3}, "UNROLL must be a power of two"),
        ({"backend": "wgmma", "num_stages": 1}, "wgmma GEMM needs num_stages >= 2"),
        (
            {"backend": "wgmma", "BLOCK_M": 128, "num_warps": 8, "num_stages": 8},
            "tile 128x128 with 8 stages needs 262208 bytes",
        ),
        ({"backend": "wgmma", "BLOCK_K": 256}, "wgmma GEMM needs BLOCK_K 128"),
    ],
)
def test_invalid_config_fields_are_named(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Fp8GemmConfig(**fields)


def test_invalid_configs_name_the_field() -> None:
    assert parse_buckets({"8": {"BLOCK_M": 16}}, "f")[8].SPLIT_K == 1  # files from before it
    with pytest.raises(ValueError, match="scale_format"):
        get_fp8_gemm_buckets("tensor", 1, 1, None)
    with pytest.raises(ValueError, match="non-empty"):
        parse_buckets({}, "f")
    with pytest.raises(ValueError, match="positive row count"):
        parse_buckets({"x": {}}, "f")
    with pytest.raises(ValueError, match=r"f\[8\]: keys must be among"):
        parse_buckets({"8": {"BLOCK_Q": 16}}, "f")
    with pytest.raises(ValueError, match=r"f\[8\]: BLOCK_M"):
        parse_buckets({"8": {"BLOCK_M": 8}}, "f")


def test_block_gemv_tiles_are_checked_when_read_or_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wide = {1: Fp8GemmConfig("gemv", BLOCK_N=256, BLOCK_K=512)}
    with pytest.raises(ValueError, match=r"\[1\]: block-scaled GEMV needs BLOCK_N dividing 128"):
        save_buckets("block", 256, 512, "GPU", wide, tmp_path)
    path = save_buckets("channel", 256, 512, "GPU", wide, tmp_path)  # any tile: per-channel
    (tmp_path / path.name.replace("channel", "block")).write_text(path.read_text())
    monkeypatch.setattr(fp8_gemm_config, "CONFIG_DIR", tmp_path)
    load_tuned_buckets.cache_clear()
    try:
        with pytest.raises(ValueError, match="BLOCK_N dividing 128"):
            get_fp8_gemm_buckets("block", 256, 512, "GPU")
        assert get_fp8_gemm_buckets("channel", 256, 512, "GPU") == wide
    finally:
        load_tuned_buckets.cache_clear()


def test_wgmma_buckets_serve_block_scales_only(tmp_path: Path) -> None:
    wgmma = {256: Fp8GemmConfig("wgmma", BLOCK_M=64, BLOCK_N=128, UNROLL=4)}
    with pytest.raises(ValueError, match=r"\[256\]: backend 'wgmma' serves block scales only"):
        save_buckets("channel", 256, 512, "GPU", wgmma, tmp_path)
    path = save_buckets("block", 256, 512, "GPU", wgmma, tmp_path)
    assert parse_buckets(json.loads(path.read_text()), str(path)) == wgmma
