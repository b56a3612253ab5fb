"""The fp16/bf16 GEMV's tile per weight shape and device, and so which shapes take it: a file
`gemv_configs/{device}.json` (device name, spaces as underscores) maps "N{N}_K{K}" to {BLOCK_N,
BLOCK_K, num_warps, num_stages}, or to null where cuBLAS (F.linear) was faster at one row
(`ferrum tune`, `benchmarks/bench_gemv.py --sweep --save`). `gemv_tile` looks a shape up in the
user's folder's file (tuned_tables), then the package's; a shape neither lists takes the GEMV
with tile_rules.gemv_tile_rule's tile."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from ferrum.kernels.device_properties import DeviceProperties
from ferrum.kernels.fp8_gemm_config import check_gemv_tiles
from ferrum.kernels.tile_rules import gemv_tile_rule
from ferrum.kernels.tuned_tables import (
    parse_shape_table,
    read_shape_tables,
    tables_ignored,
    update_shape_table,
    user_config_dir,
)

CONFIG_DIR = Path(__file__).parent / "gemv_configs"
_SHAPE_KEY = re.compile(r"N(\d+)_K(\d+)")


@dataclass(frozen=True, slots=True)
class GemvTile:
    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_gemv_tiles(False, self.BLOCK_N, self.BLOCK_K)
        if self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")


# A shape's entry: its tile, or None where F.linear was measured faster.
GemvTiles = dict[tuple[int, int], GemvTile | None]


def config_path(device_name: str, directory: Path | None = None) -> Path:
    return (CONFIG_DIR if directory is None else directory) / (
        device_name.replace(" ", "_") + ".json"
    )


def parse_tiles(data: object, where: str) -> GemvTiles:
    """Validates {"N<n>_K<k>": {GemvTile fields} or null}."""
    tiles = parse_shape_table(data, where, _SHAPE_KEY, "N<rows>_K<columns>", GemvTile)
    return cast(GemvTiles, tiles)


@functools.cache
def get_gemv_tiles(device_name: str, user_dir: Path | None = None) -> GemvTiles:
    """The shapes measured on this device, the package's file updated by `user_dir`'s (tuned
    tables); {} without either."""
    file_name = config_path(device_name).name
    return cast(GemvTiles, read_shape_tables(CONFIG_DIR, file_name, user_dir, parse_tiles))


def gemv_tile(n: int, k: int, device: DeviceProperties) -> GemvTile | None:
    """The tile one row times an [N, K] weight runs with on `device`, None for F.linear: the
    tuned entry (user folder, then package), else the rule's tile."""
    tiles = {} if tables_ignored() else get_gemv_tiles(device.name, user_config_dir())
    if (n, k) in tiles:
        return tiles[n, k]
    return GemvTile(*gemv_tile_rule(n, k, device))


def save_gemv_tiles(
    device_name: str,
    tiles: GemvTiles,
    directory: Path | None = None,
    drop: frozenset[tuple[int, int]] = frozenset(),
) -> Path:
    """Writes `tiles` as the device's file, replacing the shapes it names, marking those in
    `drop` (measured slower than cuBLAS) null and keeping the others already there."""
    updates = {**tiles, **dict.fromkeys(drop)}
    path = config_path(device_name, directory)
    return update_shape_table(path, updates, parse_tiles, lambda nk: f"N{nk[0]}_K{nk[1]}")
