from __future__ import annotations

import dataclasses

from benchmarks.fp8_bucket_merge import merged_bucket
from ferrum.kernels.fp8_gemm_config import Fp8GemmConfig

TRITON = Fp8GemmConfig("triton", BLOCK_M=32, BLOCK_N=64, SPLIT_K=2)
WGMMA = Fp8GemmConfig("wgmma", BLOCK_M=64, BLOCK_N=64, num_stages=8, UNROLL=4)
CUBLAS = Fp8GemmConfig("scaled_mm", BLOCK_M=64, BLOCK_N=128, num_stages=3)
DEFAULT = Fp8GemmConfig("scaled_mm", BLOCK_M=64, BLOCK_N=128, num_stages=4)


def _best(config: Fp8GemmConfig, us: float) -> dict:
    return {"us": us, "config": dataclasses.asdict(config)}


def test_the_fastest_of_sweep_cublas_and_the_layer_as_shipped() -> None:
    assert merged_bucket(CUBLAS, _best(WGMMA, 10.0), 12.0, 11.0, DEFAULT) == WGMMA
    assert merged_bucket(CUBLAS, _best(WGMMA, 10.0), 12.0, 9.5, DEFAULT) is None  # shipped wins
    assert merged_bucket(None, _best(WGMMA, 10.0), 12.0, 9.5, DEFAULT) is None  # nothing added
    assert merged_bucket(None, _best(WGMMA, 10.0), None, None, DEFAULT) == WGMMA  # per-channel


def test_cublas_keeps_a_triton_tile_for_where_it_does_not_run() -> None:
    as_cublas = dataclasses.replace(TRITON, backend="scaled_mm")
    assert merged_bucket(TRITON, _best(TRITON, 10.0), 8.0, 9.0, DEFAULT) == as_cublas
    # A wgmma best was never timed as a Triton tile: the bucket's own tile, else the default's.
    assert merged_bucket(CUBLAS, _best(WGMMA, 10.0), 8.0, 9.0, DEFAULT) == CUBLAS
    assert merged_bucket(TRITON, _best(WGMMA, 10.0), 8.0, 9.0, DEFAULT) == as_cublas
    assert merged_bucket(WGMMA, _best(WGMMA, 10.0), 8.0, 9.0, DEFAULT) == DEFAULT
    assert merged_bucket(None, _best(WGMMA, 10.0), 8.0, None, DEFAULT) == DEFAULT


def test_a_gemv_bucket_stays() -> None:
    gemv = Fp8GemmConfig("gemv", BLOCK_N=8, BLOCK_K=1024)
    assert merged_bucket(gemv, _best(WGMMA, 1.0), 1.0, 9.0, DEFAULT) is None
