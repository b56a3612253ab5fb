"""Launch configs of the W8A8 FP8 GEMM per scale format, weight shape, device and batch bucket:
`fp8_gemm_configs/{block|channel}_N{N}_K{K}_{device}.json` maps a bucket (the most rows it covers)
to Fp8GemmConfig fields; a batch takes the smallest bucket covering it, or the largest. The user's
folder (tuned_tables; `ferrum tune` writes it) is read before this package's; without either
file a GPU takes fp8_gemm_rule's buckets, the CPU the fixed defaults below.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from ferrum.kernels.tuned_tables import tuned_file, user_config_dir, write_table

CONFIG_DIR = Path(__file__).parent / "fp8_gemm_configs"
SCALE_FORMATS = ("block", "channel")
BACKENDS = ("triton", "scaled_mm", "gemv", "wgmma")
QUANT_MODES = ("fused", "separate")
# Rows and columns of weight covered by one block scale (and the activation group).
SCALE_BLOCK = 128
# Split-K partials are summed one after another by one program: more splits than this cost more
# in the sum than they gain in parallel reads.
MAX_SPLIT_K = 16
# Shared memory one block may use on Hopper (227 KB).
HOPPER_SHARED_MEMORY = 227 * 1024


@dataclass(frozen=True, slots=True)
class Fp8GemmConfig:
    """One launch choice. backend "scaled_mm": cuBLASLt (bf16 output only); "gemv": fp8_gemv,
    weight-only; "wgmma" (block scales): fp8_gemm_wgmma's Hopper kernel, num_stages TMA buffers,
    UNROLL K steps an iteration; else, or where those do not take the operands, the Triton tile.
    quant "fused": the Triton GEMM quantizes its activation tiles; "separate": a quantization pass
    first. SPLIT_K (Triton): programs sharing one tile's K steps. Unused fields are ignored."""

    backend: str = "triton"
    quant: str = "separate"
    BLOCK_M: int = 64
    BLOCK_N: int = 128
    BLOCK_K: int = 128
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    SPLIT_K: int = 1
    UNROLL: int = 2

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.quant not in QUANT_MODES:
            raise ValueError(f"quant must be one of {QUANT_MODES}, got {self.quant!r}")
        for name in (
            "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT_K",
            "UNROLL",
        ):  # fmt: skip
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
            if value < 16 and self.backend != "gemv":
                raise ValueError(f"{name} must be >= 16 (tl.dot) outside the gemv, got {value}")
        if self.SPLIT_K > MAX_SPLIT_K:
            raise ValueError(f"SPLIT_K must be <= {MAX_SPLIT_K}, got {self.SPLIT_K}")
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")
        if self.backend == "wgmma":
            check_wgmma_tile(
                self.BLOCK_M, self.BLOCK_N, self.num_warps, self.num_stages, self.UNROLL
            )
            if self.BLOCK_K != SCALE_BLOCK:
                raise ValueError(f"the wgmma GEMM needs BLOCK_K {SCALE_BLOCK}, got {self.BLOCK_K}")


Buckets = dict[int, Fp8GemmConfig]

# Defaults off CUDA (a GPU without a table takes fp8_gemm_rule), chosen on the H100 at Qwen3-8B
# shapes: one row takes the GEMV (1.2-2.4x cuBLASLt, slower from two rows), above it cuBLASLt
# wherever it takes the operands (3-10x these untuned tiles at M <= 64); no wgmma (at 256 rows it
# lost to cuBLASLt on gate_up). A bucket's tile fields run where its backend does not take the
# operands: decode batches narrow N tiles quantized in the GEMM, larger ones wide.
_FUSED = ("scaled_mm", "fused")
_GEMV = Fp8GemmConfig("gemv", BLOCK_N=8, BLOCK_K=1024, num_warps=4, num_stages=2)
DEFAULT_BUCKETS: dict[str, Buckets] = {
    "block": {
        1: _GEMV,
        16: Fp8GemmConfig(*_FUSED, BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_stages=4),
        64: Fp8GemmConfig(*_FUSED, BLOCK_M=32, BLOCK_N=64, GROUP_M=1, num_stages=4),
        256: Fp8GemmConfig("scaled_mm", BLOCK_M=64, BLOCK_N=128, num_stages=3),
        1 << 62: Fp8GemmConfig("scaled_mm", BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    },
    "channel": {
        1: _GEMV,
        16: Fp8GemmConfig(*_FUSED, BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_stages=4),
        64: Fp8GemmConfig(*_FUSED, BLOCK_M=32, BLOCK_N=64, GROUP_M=1, num_stages=4),
        1 << 62: Fp8GemmConfig("scaled_mm", BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    },
}


def _check_format(scale_format: str) -> None:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")


def config_path(scale_format: str, n: int, k: int, device_name: str) -> Path:
    _check_format(scale_format)
    return CONFIG_DIR / f"{scale_format}_N{n}_K{k}_{device_name.replace(' ', '_')}.json"


def parse_buckets(data: object, where: str) -> Buckets:
    """Validates {"<max rows>": {Fp8GemmConfig fields}} into buckets sorted by bound."""
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where}: must be a non-empty object of batch buckets")
    fields = {f.name for f in dataclasses.fields(Fp8GemmConfig)}
    buckets: Buckets = {}
    for bound, config in data.items():
        if not str(bound).isdigit() or int(bound) < 1:
            raise ValueError(f"{where}: bucket {bound!r} must be a positive row count")
        if not isinstance(config, dict) or not set(config) <= fields:
            raise ValueError(f"{where}[{bound}]: keys must be among {sorted(fields)}")
        try:
            buckets[int(bound)] = Fp8GemmConfig(**config)
        except ValueError as e:
            raise ValueError(f"{where}[{bound}]: {e}") from e
    return dict(sorted(buckets.items()))


def check_wgmma_tile(
    block_m: int, block_n: int, num_warps: int, num_stages: int, unroll: int
) -> None:
    """Raises ValueError unless fp8_gemm_wgmma can run this tile: rows in whole warpgroup MMAs of
    64 (4 or 8 warps), columns within one weight scale block, at least two buffers (a step's
    buffers are refilled while the next step's product still reads its own) and no more than
    Hopper's shared memory holds, UNROLL a power of two."""
    if block_m not in (64, 128) or block_n not in (16, 32, 64, 128) or num_warps not in (4, 8):
        raise ValueError(
            "the wgmma GEMM needs BLOCK_M 64 or 128, BLOCK_N 16-128 (a power of two) and 4 or 8 "
            f"warps, got BLOCK_M={block_m} BLOCK_N={block_n} num_warps={num_warps}"
        )
    if num_stages < 2:
        raise ValueError(f"the wgmma GEMM needs num_stages >= 2, got {num_stages}")
    # FP8 A and W tiles of 128 columns a buffer, 8 bytes a barrier. The 16-bit output tile reuses
    # the buffers once the K loop is done (as compiled for sm90) and, with BLOCK_N <= 128 and two
    # buffers or more, is never larger than them.
    smem = num_stages * (block_m + block_n) * SCALE_BLOCK + 8 * num_stages
    if smem > HOPPER_SHARED_MEMORY:
        raise ValueError(
            f"the wgmma tile {block_m}x{block_n} with {num_stages} stages needs {smem} bytes of "
            f"shared memory, more than Hopper's {HOPPER_SHARED_MEMORY}"
        )
    if unroll < 1 or unroll & (unroll - 1):
        raise ValueError(f"UNROLL must be a power of two, got {unroll}")


def check_gemv_tiles(block_scales: bool, block_n: int, block_k: int) -> None:
    """Raises ValueError unless fp8_gemv can run this tile: block-scaled weights need a program's
    rows within one scale block (BLOCK_N divides it) and K steps of whole scale groups."""
    for name, value in (("BLOCK_N", block_n), ("BLOCK_K", block_k)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two, got {value}")
    if block_scales and (SCALE_BLOCK % block_n or block_k % SCALE_BLOCK):
        raise ValueError(
            f"block-scaled GEMV needs BLOCK_N dividing {SCALE_BLOCK} and BLOCK_K a multiple of "
            f"{SCALE_BLOCK}, got BLOCK_N={block_n} BLOCK_K={block_k}"
        )


def _check_buckets(scale_format: str, buckets: Buckets, where: str) -> None:
    """A GEMV bucket of block-scaled weights needs rows within one scale block and K steps of
    whole scale groups (fp8_gemv), and the wgmma GEMM serves block scales only; checked when a
    file is read or written, not at a forward."""
    for bound, config in buckets.items():
        if config.backend == "wgmma" and scale_format != "block":
            raise ValueError(f"{where}[{bound}]: backend 'wgmma' serves block scales only")
        if config.backend == "gemv":
            try:
                check_gemv_tiles(scale_format == "block", config.BLOCK_N, config.BLOCK_K)
            except ValueError as e:
                raise ValueError(f"{where}[{bound}]: {e}") from e


@functools.cache
def load_tuned_buckets(
    scale_format: str, n: int, k: int, device_name: str, user_dir: Path | None = None
) -> Buckets | None:
    """The tuned buckets of this weight shape on the named device: `user_dir`'s file (see
    tuned_tables), else the packaged one; None without either."""
    _check_format(scale_format)
    path = tuned_file(CONFIG_DIR, config_path(scale_format, n, k, device_name).name, user_dir)
    if path is None:
        return None
    buckets = parse_buckets(json.loads(path.read_text()), str(path))
    _check_buckets(scale_format, buckets, str(path))
    return buckets


def get_fp8_gemm_buckets(scale_format: str, n: int, k: int, device_name: str | None) -> Buckets:
    """The tuned buckets for this weight shape on the named device (the process's user folder,
    then the package), else the fixed defaults (fp8_gemm_rule.fp8_gemm_buckets is what layers
    run: it falls back to the device's rule instead)."""
    _check_format(scale_format)
    if device_name:
        tuned = load_tuned_buckets(scale_format, n, k, device_name, user_config_dir())
        if tuned is not None:
            return tuned
    return DEFAULT_BUCKETS[scale_format]


def pick(buckets: Buckets, num_rows: int) -> Fp8GemmConfig:
    """The config of the smallest bucket covering num_rows, else of the largest."""
    for bound, config in buckets.items():
        if num_rows <= bound:
            return config
    return buckets[max(buckets)]


def save_buckets(
    scale_format: str,
    n: int,
    k: int,
    device_name: str,
    buckets: Buckets,
    directory: Path | None = None,
) -> Path:
    """Writes the buckets as the tuned file of this shape and device in `directory` (CONFIG_DIR)."""
    directory = CONFIG_DIR if directory is None else directory
    path = directory / config_path(scale_format, n, k, device_name).name
    data = {str(b): dataclasses.asdict(buckets[b]) for b in sorted(buckets)}
    _check_buckets(scale_format, parse_buckets(data, str(path)), str(path))
    write_table(path, data)
    return path
