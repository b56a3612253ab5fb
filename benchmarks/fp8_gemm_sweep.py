"""The tile sweeps of bench_fp8_gemm.py: the grids of Triton, wgmma and GEMV tiles it times per
shape, M and scale format, and the loops that time them (CUDA graphs over the weight copies)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING

import torch

from benchmarks.gpu_timing import graph_us
from ferrum.kernels.fp8_gemm import w8a8_block_fp8_matmul, w8a8_channel_fp8_matmul
from ferrum.kernels.fp8_gemm_config import Fp8GemmConfig
from ferrum.kernels.fp8_gemm_wgmma import wgmma_gemm_takes
from ferrum.kernels.fp8_gemv import fp8_gemv
from ferrum.kernels.fp8_linear import fp8_block_linear
from ferrum.kernels.fp8_quant import per_token_group_quant_fp8, per_token_quant_fp8

if TYPE_CHECKING:
    from benchmarks.bench_fp8_gemm import Weights


# Output tiles a sweep config may make, times its splits, at most: more only adds partials to
# sum; the H100's 132 SMs are full well before.
SWEEP_MAX_PROGRAMS = 1024


def sweep_configs(m: int, n: int, k: int) -> list[Fp8GemmConfig]:
    """The coarse grid for M rows of an N x K weight (4 warps, 4 stages): BLOCK_M the next power
    of two of M and 64 (or half of it above 64 rows), narrow-to-wide N tiles, split-K where the
    output tiles are few, activations quantized inside the GEMM or by a pass before it."""
    block_m = min(128, max(16, 1 << (m - 1).bit_length()))
    # 64 rows: Hopper's FP8 wgmma tile, padded at small M (narrower tiles convert W to fp16).
    block_ms = sorted({block_m, 64} if m <= 64 else {block_m, block_m // 2})
    configs = []
    for q, bm, bn, split in itertools.product(
        ("fused", "separate"), block_ms, (32, 64, 128, 256), (1, 2, 4, 8)
    ):
        tiles = -(-m // bm) * -(-n // bn)
        if tiles * split > SWEEP_MAX_PROGRAMS or split > -(-k // 128) or (bn == 256 and m <= 32):
            continue
        configs.append(
            Fp8GemmConfig(
                quant=q,
                BLOCK_M=bm,
                BLOCK_N=bn,
                GROUP_M=1 if m <= 64 else 8,
                num_warps=4,
                num_stages=4,
                SPLIT_K=split,
            )  # fmt: skip
        )
    return configs


# Tiles of the Hopper wgmma GEMM (block scales): (BLOCK_M, BLOCK_N, num_warps, num_stages, UNROLL).
# 64-row tiles for decode batches (more programs), 128-row tiles with two warpgroups above; deep
# buffers for narrow tiles. In the 2026-11-28 grid the fastest at Qwen3-8B's shapes were among
# these at every M from 64 to 2048.
WGMMA_SWEEP_TILES = (
    (64, 64, 4, 4, 2), (64, 64, 4, 6, 4), (64, 64, 4, 8, 4), (64, 128, 4, 3, 2),
    (64, 128, 4, 4, 2), (64, 128, 4, 6, 2), (128, 64, 8, 6, 2), (128, 64, 8, 6, 4),
    (128, 128, 8, 4, 2),
)  # fmt: skip


def wgmma_configs() -> list[Fp8GemmConfig]:
    return [
        Fp8GemmConfig("wgmma", BLOCK_M=bm, BLOCK_N=bn, num_warps=nw, num_stages=ns, UNROLL=un)
        for bm, bn, nw, ns, un in WGMMA_SWEEP_TILES
    ]


def refine_configs(best: list[Fp8GemmConfig]) -> list[Fp8GemmConfig]:
    """Around each of the coarse grid's best: 3 or 5 stages, and 8 warps for wide tiles."""
    configs = []
    for config in best:
        for nw, ns in itertools.product((4, 8), (3, 4, 5)):
            if (nw, ns) == (4, 4) or (nw == 8 and config.BLOCK_M * config.BLOCK_N < 64 * 128):
                continue
            configs.append(dataclasses.replace(config, num_warps=nw, num_stages=ns))
    return configs


# (BLOCK_N, BLOCK_K) of the GEMV sweep: 8-32 rows of 512-1024 columns, and longer K tiles of
# fewer rows (16 KB or less of FP8 weights a tile, as the bf16 GEMV's fastest tiles read). A warp
# reads 256 columns of a row (8 a thread); with at least num_warps * 256 columns a row chunk stays
# within the threads that multiply it, which tends to help but is not required (the sweep decides).
GEMV_SWEEP_TILES = (
    *itertools.product((8, 16, 32), (512, 1024)),
    (1, 4096),
    (2, 2048),
    (2, 4096),
    (4, 1024),
    (4, 2048),
    (4, 4096),
    (8, 2048),
    (16, 2048),
)


def gemv_fn(x: torch.Tensor, w: Weights, scale_format: str, config: Fp8GemmConfig):
    weights = w.block if scale_format == "block" else w.channel
    tiles = (config.BLOCK_N, config.BLOCK_K, config.num_warps, config.num_stages)
    return lambda i: fp8_gemv(x, *weights[i], x.dtype, scale_format == "block", *tiles)


def run_gemv_sweep(x: torch.Tensor, w: Weights, scale_format: str, iters: int) -> dict:
    best = None
    for (bn, bk), nw, ns in itertools.product(GEMV_SWEEP_TILES, (4, 8), (1, 2)):
        config = Fp8GemmConfig("gemv", BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
        try:
            us = graph_us(gemv_fn(x, w, scale_format, config), len(w.bf16), iters)
        except Exception as exc:  # a tile the compiler rejects
            print(f"    skip {config}: {type(exc).__name__}")
            continue
        if best is None or us < best["us"]:
            best = {"us": us, "config": dataclasses.asdict(config)}
    return best or {}


def sweep_fn(x: torch.Tensor, w: Weights, scale_format: str, config: Fp8GemmConfig):
    if config.backend == "wgmma":  # quantization pass + the wgmma GEMM, as the layer runs it
        return lambda i: fp8_block_linear(x, *w.block[i], buckets={1 << 62: config})
    if scale_format == "block":
        gemm, weights, quant = w8a8_block_fp8_matmul, w.block, per_token_group_quant_fp8
    else:
        gemm, weights, quant = w8a8_channel_fp8_matmul, w.channel, per_token_quant_fp8
    if config.quant == "fused":
        return lambda i: gemm(x, *weights[i], x.dtype, config)

    def separate(i: int) -> torch.Tensor:
        q, scales = quant(x)
        return gemm(q, *weights[i], x.dtype, config, a_scale=scales)

    return separate


def run_sweep(
    x: torch.Tensor, w: Weights, scale_format: str, iters: int, backends: tuple[str, ...]
) -> dict:
    """The fastest config of `backends`: Triton's coarse grid, then its best three refined; the
    wgmma tiles (block scales on Hopper)."""
    n, k = w.bf16[0].shape

    def time_configs(configs: list[Fp8GemmConfig]) -> list[tuple[float, Fp8GemmConfig]]:
        timed = []
        for config in configs:
            try:
                us = graph_us(sweep_fn(x, w, scale_format, config), len(w.bf16), iters)
            except Exception as exc:  # a tile the compiler rejects (shared memory)
                print(f"    skip {config}: {type(exc).__name__}")
                continue
            timed.append((us, config))
        return sorted(timed, key=lambda t: t[0])

    timed = []
    if "triton" in backends:
        coarse = time_configs(sweep_configs(x.shape[0], n, k))
        timed += coarse + time_configs(refine_configs([c for _, c in coarse[:3]]))
    if (
        "wgmma" in backends
        and scale_format == "block"
        and wgmma_gemm_takes(x.device, x.dtype, n, k)
    ):
        timed += time_configs(wgmma_configs())
    if not timed:
        return {}
    us, config = min(timed, key=lambda t: t[0])
    return {"us": us, "config": dataclasses.asdict(config)}
