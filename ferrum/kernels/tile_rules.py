"""The arithmetic the default tile rules share (fp8_gemm_rule, fused_moe_rule, gemv_config), and
the GEMV's rule. A rule sees the shape and a `DeviceProperties`: programs are counted in waves
over the SMs (a launch of fewer programs than SMs leaves SMs idle), a tile's pipeline stages must
fit the shared memory one program may use, and split-K is taken only where the output tiles are
fewer than the waves wanted and K is long enough that every split keeps several K steps."""

from __future__ import annotations

from ferrum.kernels.device_properties import KIB, DeviceProperties

# Shared memory left to the compiler beyond the stage buffers (layout conversions, barriers).
SMEM_RESERVE = 8 * KIB
# K steps each split-K program keeps at least: fewer and the partial sums cost more than the
# parallel reads gain.
MIN_STEPS_PER_SPLIT = 8
MAX_SPLIT_K = 16
# The GEMV's longest K tile (elements) and the programs it wants per SM (bytes in flight).
GEMV_MAX_BLOCK_K = 2048
GEMV_PROGRAMS_PER_SM = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def prev_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x.bit_length() - 1)


def fit_stages(stage_bytes: int, device: DeviceProperties, max_stages: int) -> int:
    """The most pipeline stages (<= max_stages, >= 1) of stage_bytes each that fit the device's
    shared memory per program, SMEM_RESERVE kept aside."""
    room = device.shared_memory_per_block - SMEM_RESERVE
    return max(1, min(max_stages, room // stage_bytes))


def split_k(num_tiles: int, k_steps: int, target_programs: int) -> int:
    """The smallest power-of-two split of K that brings num_tiles * split to target_programs,
    keeping MIN_STEPS_PER_SPLIT K steps a split (1: no split)."""
    split = 1
    while (
        num_tiles * split < target_programs
        and split * 2 <= MAX_SPLIT_K
        and k_steps // (split * 2) >= MIN_STEPS_PER_SPLIT
    ):
        split *= 2
    return split


def gemv_block_k(k: int, multiple: int = 1) -> int:
    """The GEMV's K tile: the largest power of two <= min(GEMV_MAX_BLOCK_K, K / 2) that divides K
    (no masked tail; two steps at least, so loads of the next overlap the sums of this one) and is
    a multiple of `multiple`; for a K no such power divides, the largest <= that bound."""
    bound = max(multiple, prev_pow2(min(GEMV_MAX_BLOCK_K, max(1, k // 2))))
    block_k = bound
    while block_k >= max(multiple, 16):
        if k % block_k == 0:
            return block_k
        block_k //= 2
    return bound


def gemv_block_n(n: int, device: DeviceProperties, widest: int = 4) -> int:
    """The GEMV's rows a program: `widest`, halved (to 1) while the programs would fill fewer than
    GEMV_PROGRAMS_PER_SM a SM."""
    block_n = widest
    while block_n > 1 and cdiv(n, block_n) < GEMV_PROGRAMS_PER_SM * device.num_sms:
        block_n //= 2
    return block_n


def gemv_tile_rule(n: int, k: int, device: DeviceProperties) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of a one-row GEMV over an [N, K] weight (fp16,
    bf16 or FP8): 4 rows of up to 2048 columns (the H100 tables' choice at most shapes), fewer
    rows where N is short, 4 warps, 2 stages. The K tile is a multiple of 128 (block scales)
    wherever K is."""
    block_k = gemv_block_k(k, 128 if k % 128 == 0 else 1)
    return gemv_block_n(n, device), block_k, 4, 2
