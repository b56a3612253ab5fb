"""How bench_fp8_gemm.py --save / --save-gemv merge what a sweep measured into a shape's tuned
FP8 GEMM buckets (ferrum/kernels/fp8_gemm_configs/)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ferrum.kernels.fp8_gemm_config import (
    Buckets,
    Fp8GemmConfig,
    config_path,
    get_fp8_gemm_buckets,
    parse_buckets,
)


def base_buckets(scale_format: str, n: int, k: int, device_name: str, directory: Path) -> Buckets:
    """What --save and --save-gemv merge into: this shape's file in `directory` when one is there
    (an earlier save), else the tuned file in fp8_gemm_configs/, else the defaults."""
    path = directory / config_path(scale_format, n, k, device_name).name
    if path.is_file():
        return parse_buckets(json.loads(path.read_text()), str(path))
    return dict(get_fp8_gemm_buckets(scale_format, n, k, device_name))


def merged_bucket(
    current: Fp8GemmConfig | None,
    best: dict,
    scaled_mm_us: float | None,
    current_us: float | None,
    default: Fp8GemmConfig,
) -> Fp8GemmConfig | None:
    """What --save writes for one swept M, or None to leave the buckets as they are.
    `current`: bucket M as it was (None: M had no bucket of its own); `best`: the sweep's fastest
    ({"us", "config"}); `scaled_mm_us`: cuBLASLt's time; `current_us`: the layer's time as shipped
    in fp8_gemm_configs/ (the block_linear row, so block scales only; None elsewhere; with --save
    pointing elsewhere it may not be `current`'s time); `default`: the default bucket covering M.
    - A GEMV bucket stays (--gemv-sweep times it).
    - cuBLASLt, where it beat the sweep, is saved as backend "scaled_mm" with a Triton tile for
      where it does not run: the sweep's best if that is a Triton tile (timed), else the bucket's
      own Triton or scaled_mm tile, else the default's (never a wgmma tile read as Triton).
    - Nothing changes where the layer as shipped was at least as fast."""
    if current is not None and current.backend == "gemv":
        return None
    config, fastest = Fp8GemmConfig(**best["config"]), best["us"]
    if scaled_mm_us is not None and scaled_mm_us < fastest:
        if config.backend == "triton":
            tile = config
        elif current is not None and current.backend in ("triton", "scaled_mm"):
            tile = current
        else:
            tile = default
        config, fastest = dataclasses.replace(tile, backend="scaled_mm"), scaled_mm_us
    if current_us is not None and current_us <= fastest:
        return None
    return config
