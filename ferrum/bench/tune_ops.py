"""The search space of each `ferrum tune` op (`candidates`); tune_gpu times them.

Spaces: gemv, BLOCK_N 1-8 x BLOCK_K 512-4096 x 4/8 warps x 1/2 stages; gemv_rows, BLOCK_N
16-128 x BLOCK_K 64-256 x split-K 1-8 (2+ K steps a split) x 2-4 stages; both F.linear (None);
fp8_gemm at one row the FP8 GEMV's grid, above it Triton tiles (the bucket's rows and a second
height, 32-128 columns, split-K that keeps 4 K steps a split, 3-5 stages; up to 64 rows also
quantizing the activations inside the GEMM), the Hopper wgmma tiles (block scales) and
cuBLASLt where it takes the operands; moe_grouped BLOCK_M 16-128 (up to four times an expert's
average rows) x N, K 64/128 x 4/8 warps x 3/4 stages; moe_small the gate/up and down GEMV
widths, K tiles and the three ways of summing a token's choices; moe_w8a8 the grouped
heights x N 128/256 (whole 128-column groups) x K 64/128 x 4/8 warps x 2-4 stages.
Tiles a kernel refuses (its config's checks) are left out."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from ferrum.bench.tune_shapes import LinearShape, MoEShape, TuneTask
from ferrum.bench.tune_store import Config
from ferrum.kernels.device_properties import DeviceProperties
from ferrum.kernels.fp8_gemm_config import SCALE_BLOCK, Fp8GemmConfig
from ferrum.kernels.gemv_config import GemvTile
from ferrum.kernels.gemv_rows import GemvRowsTile
from ferrum.kernels.tile_rules import cdiv, next_pow2


def _valid(make: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
    try:
        return [make(*args, **kwargs)]
    except ValueError:  # a tile the kernel does not take
        return []


def gemv_candidates(shape: LinearShape) -> list[Config]:
    widest_k = next_pow2(shape.k)
    space = itertools.product((1, 2, 4, 8), (512, 1024, 2048, 4096), (4, 8), (1, 2))
    tiles = [GemvTile(*t) for t in space if t[1] <= max(512, widest_k)]
    return [None, *tiles]


# The few-row linear's tiles: 16-32 columns run mma.sync in small programs, several an SM;
# 64-128 run wgmma. benchmarks/bench_gemv_rows.py sweeps the same space.
GEMV_ROWS_SPACE = {
    "BLOCK_N": (16, 32, 64, 128),
    "BLOCK_K": (64, 128, 256),
    "SPLIT_K": (1, 2, 4, 8),
    "num_warps": (4,),
    "num_stages": (2, 3, 4),
}


def gemv_rows_candidates(shape: LinearShape) -> list[Config]:
    tiles: list[Config] = [None]
    for values in itertools.product(*GEMV_ROWS_SPACE.values()):
        tile = GemvRowsTile(**dict(zip(GEMV_ROWS_SPACE, values)))
        if tile.SPLIT_K == 1 or cdiv(shape.k, tile.BLOCK_K) >= 2 * tile.SPLIT_K:
            tiles.append(tile)
    return tiles


def fp8_gemm_candidates(
    shape: LinearShape, m: int, device: DeviceProperties, scale_format: str
) -> list[Config]:
    """Module docstring; tiles the kernels refuse (Fp8GemmConfig's checks) are left out."""
    block = scale_format == "block"
    if block and shape.k % SCALE_BLOCK:
        return []
    found: list[Config] = []
    if m == 1:
        for bn, bk, nw, ns in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8), (1, 2)):
            found += _valid(Fp8GemmConfig, "gemv", BLOCK_N=bn, BLOCK_K=bk, num_warps=nw,
                            num_stages=ns)  # fmt: skip
        return found
    rows = min(128, max(16, next_pow2(m)))
    heights = sorted({rows, 64 if m <= 64 else rows // 2})
    k_steps = cdiv(shape.k, SCALE_BLOCK)
    for bm, bn, split, ns in itertools.product(heights, (32, 64, 128), (1, 2, 4, 8), (3, 4, 5)):
        if split > 1 and k_steps // split < 4 or ns == 5 and bm > 64:
            continue
        warps = (4, 8) if bm * bn >= 64 * 128 else (4,)
        # Activations quantized inside the GEMM (one launch fewer) at the bucket's own height.
        quants = ("separate", "fused") if m <= 64 and bm == heights[0] else ("separate",)
        for nw, quant in itertools.product(warps, quants):
            found += _valid(Fp8GemmConfig, "triton", quant, BLOCK_M=bm, BLOCK_N=bn,
                            SPLIT_K=split, GROUP_M=1 if m <= 64 else 8, num_warps=nw,
                            num_stages=ns)  # fmt: skip
    if block and device.is_hopper:
        for bm, bn, ns, un in itertools.product((64, 128), (64, 128), (4, 6, 8), (2, 4)):
            if bm == 128 and m <= 64:
                continue
            found += _valid(Fp8GemmConfig, "wgmma", BLOCK_M=bm, BLOCK_N=bn, num_stages=ns,
                            num_warps=4 if bm == 64 else 8, UNROLL=un)  # fmt: skip
    if device.is_hopper if block else device.has_fp8_tensor_cores:
        found.append(Fp8GemmConfig("scaled_mm", BLOCK_M=128, BLOCK_N=128, num_warps=8))
    return found


def moe_grouped_candidates(shape: MoEShape, num_tokens: int) -> list[Config]:
    rows = num_tokens * shape.top_k / shape.num_experts
    tallest = max(16, 4 * next_pow2(int(rows) + 1))
    space = itertools.product((16, 32, 64, 128), (64, 128), (64, 128), (4, 8), (3, 4))
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    return [dict(zip(keys, c)) for c in space if c[0] <= tallest]


def moe_w8a8_candidates(shape: MoEShape, num_tokens: int) -> list[Config]:
    rows = num_tokens * shape.top_k / shape.num_experts
    tallest = max(16, 4 * next_pow2(int(rows) + 1))
    space = itertools.product((16, 32, 64, 128), (128, 256), (64, 128), (4, 8), (2, 3, 4))
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    return [dict(zip(keys, c)) for c in space if c[0] <= tallest]


def moe_small_candidates(shape: MoEShape) -> list[Config]:
    sums = ((min(8, next_pow2(shape.top_k)), 0), (1, 0), (1, 1))  # (DOWN_BLOCK_E, DOWN_SPLIT)
    found: list[Config] = []
    for gu_n, gu_k, (e, split), d_n, d_k, nw in itertools.product(
        (8, 16, 32), (256, 512), sums, (8, 16, 32), (256, 1024), (4, 8)
    ):
        found.append({
            "GATE_UP_BLOCK_N": gu_n, "GATE_UP_BLOCK_K": gu_k, "DOWN_BLOCK_E": e,
            "DOWN_SPLIT": split, "DOWN_BLOCK_N": d_n, "DOWN_BLOCK_K": d_k, "num_warps": nw,
            "num_stages": 2,
        })  # fmt: skip
    return found


def candidates(
    task: TuneTask, device: DeviceProperties, scale_format: str = "block"
) -> list[Config]:
    """The configs `ferrum tune` times for one task (module docstring)."""
    shape = task.shape
    if task.op == "gemv":
        assert isinstance(shape, LinearShape)
        return gemv_candidates(shape)
    if task.op == "gemv_rows":
        assert isinstance(shape, LinearShape)
        return gemv_rows_candidates(shape)
    if task.op == "fp8_gemm":
        assert isinstance(shape, LinearShape)
        return fp8_gemm_candidates(shape, task.m, device, scale_format)
    assert isinstance(shape, MoEShape)
    if task.op == "moe_grouped":
        return moe_grouped_candidates(shape, task.m)
    if task.op == "moe_w8a8":
        return moe_w8a8_candidates(shape, task.m)
    return moe_small_candidates(shape)
