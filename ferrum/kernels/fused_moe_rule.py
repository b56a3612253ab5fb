"""The fused MoE's tiles on a GPU without a tuned table, from the expert shapes, the batch and the
device, and the lookup fused_moe takes (`moe_configs`: tuned sections, else these rules).
Grouped GEMM (`grouped_rule`), by the rows an expert gets on average (pairs / experts):
BLOCK_M 16 under 8 rows, 32 under 32, 64 under 128, else 128 (the H100 table's steps); 64
columns, 128 once experts average 64 rows (full tiles, compute bound); BLOCK_K 128 for tiles up
to 64x64, else 64; 8 warps from 64x128; stages filling shared memory, at most 4 (3 from 64 rows).
Small batches (`small_rule`): each GEMV's rows a program the widest of 32/16/8 that still makes
two waves of programs (four for FP8 experts' gate/up: half the bytes a row); one or two tokens
sum all their choices in one down program (FP8 experts: a program a choice, DOWN_SPLIT), having
too few programs to hide a choice's wait. W8A8 (`w8a8_rule`): the grouped rule's BLOCK_M, one
128-column group a column tile, K steps of 128 (one scale column); taken from W8A8_MIN_TOKENS
tokens on sm89+ (`uses_fp8_activations`), weight-only below (the GEMV path)."""

from __future__ import annotations

import functools

from ferrum.kernels.device_properties import DeviceProperties
from ferrum.kernels.fused_moe_config import (
    DEFAULT_GROUPED,
    DEFAULT_SMALL,
    DEFAULT_W8A8,
    W8A8_BLOCK,
    Buckets,
    pick,
    tuned_sections,
)
from ferrum.kernels.tile_rules import cdiv, fit_stages, next_pow2
from ferrum.kernels.tuned_tables import tables_ignored

# (average rows an expert gets below which, BLOCK_M) of the grouped GEMM; 128 beyond.
_ROWS_TO_BLOCK_M = ((8, 16), (32, 32), (128, 64))
# Token counts the rule's tables list (`rule_buckets`): the H100 tables' and every power of two
# between, then one bucket for all larger batches.
GROUPED_RULE_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 1 << 62)
SMALL_RULE_BUCKETS = (1, 2, 4, 8)
_GEMV_WIDTHS = (32, 16, 8)
_GEMV_PROGRAMS_PER_SM = 2
# FP8 experts run W8A8 (FP8 activations, grouped GEMMs) from this many tokens: every batch past
# the small-batch GEMVs (fused_moe_small_batch.SMALL_BATCH_MAX_TOKENS = 8), which stay
# weight-only. One number to move once measured.
W8A8_MIN_TOKENS = 9


def uses_fp8_activations(
    num_tokens: int, device: DeviceProperties | None, forced: bool | None = None
) -> bool:
    """Whether FP8 experts run W8A8 for a batch of num_tokens: `forced` when given (True needs
    FP8 tensor cores, sm89+, or the CPU interpreter), else from W8A8_MIN_TOKENS on a GPU with
    FP8 tensor cores (weight-only on older GPUs and off CUDA)."""
    if forced is not None:
        if forced and device is not None and not device.has_fp8_tensor_cores:
            raise ValueError(
                f"fp8_activations: {device.name} (sm{device.capability[0]}{device.capability[1]})"
                " has no FP8 tensor cores (sm89+): its FP8 experts run weight-only"
            )
        return forced
    return device is not None and device.has_fp8_tensor_cores and num_tokens >= W8A8_MIN_TOKENS


def moe_configs(
    num_tokens: int,
    num_experts: int,
    inter: int,
    hidden: int,
    top_k: int,
    device: DeviceProperties | None,
    fp8: bool = False,
) -> tuple[dict[str, int], dict[str, int]]:
    """(grouped config, small-batch config) for a batch of num_tokens: each from the tuned files
    of this device (fused_moe_config.tuned_sections), else the rules as tables (`rule_buckets`:
    the same bucket semantics); off CUDA (None) the fixed defaults."""
    if device is None:
        return pick(DEFAULT_GROUPED, num_tokens), pick(DEFAULT_SMALL, num_tokens)
    tuned = {} if tables_ignored() else tuned_sections(num_experts, inter, hidden, device.name, fp8)
    shape = (num_experts, inter, hidden, top_k, device, fp8)
    grouped = tuned.get("grouped") or rule_buckets("grouped", *shape)
    small = tuned.get("small") or rule_buckets("small", *shape)
    return pick(grouped, num_tokens), pick(small, num_tokens)


def w8a8_configs(
    num_tokens: int,
    num_experts: int,
    inter: int,
    hidden: int,
    top_k: int,
    device: DeviceProperties | None,
) -> dict[str, int]:
    """The W8A8 grouped config for a batch of num_tokens: the "grouped_w8a8" section of this
    device's FP8 tuned files, else `w8a8_rule` as a table; off CUDA (None) DEFAULT_W8A8."""
    if device is None:
        return pick(DEFAULT_W8A8, num_tokens)
    shape = (num_experts, inter, hidden, top_k, device, True)
    tuned = {} if tables_ignored() else tuned_sections(*shape[:3], device.name, True)
    return pick(tuned.get("grouped_w8a8") or rule_buckets("grouped_w8a8", *shape), num_tokens)


def grouped_rule(
    num_tokens: int,
    num_experts: int,
    inter: int,
    hidden: int,
    top_k: int,
    device: DeviceProperties,
    fp8: bool = False,
) -> dict[str, int]:
    """The grouped GEMMs' tile (module docstring); activations 16-bit, weights FP8 with fp8."""
    rows = num_tokens * top_k / max(1, num_experts)
    block_m = next((bm for bound, bm in _ROWS_TO_BLOCK_M if rows < bound), 128)
    block_n = 128 if rows >= 64 else 64
    block_k = 128 if block_m * block_n <= 64 * 64 else 64
    stage_bytes = block_k * (block_m * 2 + block_n * (1 if fp8 else 2))
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "num_warps": 8 if block_m * block_n >= 64 * 128 else 4,
        "num_stages": fit_stages(stage_bytes, device, 4 if block_m <= 32 else 3),
    }


def w8a8_rule(
    num_tokens: int,
    num_experts: int,
    inter: int,
    hidden: int,
    top_k: int,
    device: DeviceProperties,
    fp8: bool = True,
) -> dict[str, int]:
    """The W8A8 grouped GEMMs' tile (module docstring): 1-byte operands, and the gate/up GEMM
    reads two weight tiles a K step (gate and up), which sizes its stages."""
    block_m = grouped_rule(num_tokens, num_experts, inter, hidden, top_k, device, True)["BLOCK_M"]
    block_n = block_k = W8A8_BLOCK
    stage_bytes = block_k * (block_m + 2 * block_n)
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "num_warps": 8 if block_m >= 64 else 4,
        "num_stages": fit_stages(stage_bytes, device, 4 if block_m <= 64 else 3),
    }


def _widest(rows: int, programs_per_row: int, device: DeviceProperties, waves: int = 1) -> int:
    """The widest of _GEMV_WIDTHS whose programs make `waves` times _GEMV_PROGRAMS_PER_SM a SM."""
    target = waves * _GEMV_PROGRAMS_PER_SM * device.num_sms
    return next(
        (w for w in _GEMV_WIDTHS if programs_per_row * cdiv(rows, w) >= target), _GEMV_WIDTHS[-1]
    )


def small_rule(
    num_tokens: int,
    num_experts: int,
    inter: int,
    hidden: int,
    top_k: int,
    device: DeviceProperties,
    fp8: bool = False,
) -> dict[str, int]:
    """The small-batch GEMVs' tiles (module docstring): K tiles of 256 (16-byte loads)."""
    few = num_tokens <= 2
    split = int(fp8 and few)
    # The down GEMV runs a program per token (per pair with DOWN_SPLIT) and column tile.
    down_programs = num_tokens * top_k if split else num_tokens
    return {
        "GATE_UP_BLOCK_N": _widest(inter, num_tokens * top_k, device, 2 if fp8 else 1),
        "GATE_UP_BLOCK_K": 256,
        "DOWN_BLOCK_E": min(8, next_pow2(top_k)) if few and not split else 1,
        "DOWN_SPLIT": split,
        "DOWN_BLOCK_N": _widest(hidden, down_programs, device),
        "DOWN_BLOCK_K": 256,
        "num_warps": 4 if few else 8,
        "num_stages": 2,
    }


@functools.cache
def rule_buckets(
    section: str,
    num_experts: int,
    inter: int,
    hidden: int,
    top_k: int,
    device: DeviceProperties,
    fp8: bool = False,
) -> Buckets:
    """The rule as a table section ("grouped", "small" or "grouped_w8a8") at the token counts
    tables list."""
    rule, bounds = {
        "grouped": (grouped_rule, GROUPED_RULE_BUCKETS),
        "small": (small_rule, SMALL_RULE_BUCKETS),
        "grouped_w8a8": (w8a8_rule, GROUPED_RULE_BUCKETS),
    }[section]
    return {t: rule(t, num_experts, inter, hidden, top_k, device, fp8) for t in bounds}
