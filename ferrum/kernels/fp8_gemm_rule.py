"""The FP8 GEMM's buckets on a GPU without a tuned table (`fp8_gemm_rule`), and the lookup FP8
linears take (`fp8_gemm_buckets`): the user's tuned file, the packaged one, else the rule.
  1 row      the weight-only GEMV (tile_rules.gemv_tile_rule);
  2-16       a 16x64 Triton tile, K split to two waves of programs; cuBLASLt instead (block
             scales, Hopper) where even split they make under 1.5 waves;
  17-256     block scales on Hopper: wgmma 64x64 (64x128 above 64 rows where those make half a
             wave; cuBLASLt above 128 rows where they make four), buffers up to 128 KB, 4
             stages where the tiles make more than a wave; else a
             Triton tile of the rows (<= 64, then 64, 128), narrowed to 32 columns and K split
             until one wave; per-channel above 64 rows: cuBLASLt where FP8 tensor cores are;
  larger     cuBLASLt where it takes the operands, else a 128x128 Triton tile, 8 warps.
Triton stages fill the shared memory a program may use (at most 4; 3 for 128x128)."""

from __future__ import annotations

import functools

from ferrum.kernels.device_properties import DeviceProperties
from ferrum.kernels.fp8_gemm_config import (
    DEFAULT_BUCKETS,
    HOPPER_SHARED_MEMORY,
    SCALE_BLOCK,
    Buckets,
    Fp8GemmConfig,
    load_tuned_buckets,
)
from ferrum.kernels.tile_rules import cdiv, fit_stages, gemv_tile_rule, next_pow2, split_k
from ferrum.kernels.tuned_tables import tables_ignored, user_config_dir

# The bucket bounds the rule fills: those of the H100 tables.
RULE_BUCKETS = (1, 16, 32, 64, 128, 256, 1 << 62)
# wgmma buffers a program keeps in flight at most, and its deepest pipeline.
WGMMA_BUFFER_BYTES = 128 * 1024
WGMMA_MAX_STAGES = 8
# Stages of a wgmma tile when its tiles make more than one wave: two or three programs then share
# an SM (64 KB / 96 KB of buffers each), one's epilogue hidden behind another's loads. Every
# multi-wave wgmma entry of the H100 and H200 tables took 4 (and unroll 2); one wave took 6-8.
WGMMA_MULTI_WAVE_STAGES = 4


def fp8_gemm_buckets(scale_format: str, n: int, k: int, device: DeviceProperties | None) -> Buckets:
    """The buckets an [N, K] FP8 weight runs with on `device`: tuned (user folder, then the
    package), else the rule; off CUDA (None), the fixed DEFAULT_BUCKETS."""
    if device is None:
        return DEFAULT_BUCKETS[scale_format]
    if tables_ignored():
        return fp8_gemm_rule(scale_format, n, k, device)
    tuned = load_tuned_buckets(scale_format, n, k, device.name, user_config_dir())
    return tuned if tuned is not None else fp8_gemm_rule(scale_format, n, k, device)


@functools.cache
def fp8_gemm_rule(scale_format: str, n: int, k: int, device: DeviceProperties) -> Buckets:
    """The rule's buckets (module docstring) for an [N, K] weight with these scales."""
    return {m: bucket_rule(scale_format, n, k, m, device) for m in RULE_BUCKETS}


def bucket_rule(
    scale_format: str, n: int, k: int, m: int, device: DeviceProperties
) -> Fp8GemmConfig:
    """The rule's config for batches of up to m rows."""
    if m == 1:
        block_n, block_k, num_warps, num_stages = gemv_tile_rule(n, k, device)
        return Fp8GemmConfig(
            "gemv", BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages
        )
    block = scale_format == "block"
    cublas = device.is_hopper if block else device.has_fp8_tensor_cores
    if m > 256 or (m > 64 and not block and cublas):
        return _large_tile(device, "scaled_mm" if cublas else "triton")
    if block and device.is_hopper and m > 16:
        # Four waves of wide tiles and more is bound by the tensor cores: cuBLASLt's GEMM.
        if m > 128 and cdiv(m, 64) * cdiv(n, 128) >= 4 * device.num_sms:
            return _large_tile(device, "scaled_mm")
        return _wgmma_tile(n, m, device)
    config = _triton_tile(n, k, m, device)
    programs = cdiv(m, config.BLOCK_M) * cdiv(n, config.BLOCK_N) * config.SPLIT_K
    if m <= 16 and cublas and block and 2 * programs < 3 * device.num_sms:
        return Fp8GemmConfig(
            "scaled_mm", "fused", BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, GROUP_M=1,
            num_stages=config.num_stages,
        )  # fmt: skip
    return config


def _triton_tile(n: int, k: int, m: int, device: DeviceProperties) -> Fp8GemmConfig:
    """Rows of the bucket (16-64, then 64, then 128); 64 columns (128 above 64 rows), narrowed
    to 32 for tiles of 64 rows or more while they make less than a wave; K split to two waves of
    programs up to 16 rows (bound by bandwidth), one wave above."""
    block_m = max(16, next_pow2(m)) if m <= 64 else (64 if m <= 128 else 128)
    block_n = 64 if m <= 64 else 128
    while block_m >= 64 and block_n > 32 and cdiv(m, block_m) * cdiv(n, block_n) < device.num_sms:
        block_n //= 2
    tiles = cdiv(m, block_m) * cdiv(n, block_n)
    target = (2 if m <= 16 else 1) * device.num_sms
    split = split_k(tiles, cdiv(k, SCALE_BLOCK), target)
    # FP8 A and W tiles of BLOCK_K columns a stage (activations quantized by a pass before).
    stages = fit_stages((block_m + block_n) * SCALE_BLOCK, device, 4)
    return Fp8GemmConfig(
        "triton", BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=1 if m <= 64 else 8,
        num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=stages, SPLIT_K=split,
    )  # fmt: skip


def _wgmma_tile(n: int, m: int, device: DeviceProperties) -> Fp8GemmConfig:
    block_n = 64
    if m > 64 and 2 * cdiv(m, 64) * cdiv(n, 128) >= device.num_sms:
        block_n = 128
    stage_bytes = (64 + block_n) * SCALE_BLOCK
    smem = min(device.shared_memory_per_block, HOPPER_SHARED_MEMORY)
    stages = min(WGMMA_MAX_STAGES, WGMMA_BUFFER_BYTES // stage_bytes, smem // (stage_bytes + 8))
    multi_wave = cdiv(m, 64) * cdiv(n, block_n) > device.num_sms
    if multi_wave:
        stages = min(stages, WGMMA_MULTI_WAVE_STAGES)
    return Fp8GemmConfig(
        "wgmma", BLOCK_M=64, BLOCK_N=block_n, num_warps=4, num_stages=max(2, stages),
        UNROLL=4 if block_n == 64 and not multi_wave else 2,
    )  # fmt: skip


def _large_tile(device: DeviceProperties, backend: str) -> Fp8GemmConfig:
    stages = fit_stages(2 * 128 * SCALE_BLOCK, device, 3)
    return Fp8GemmConfig(
        backend, BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=stages
    )
