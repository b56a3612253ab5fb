"""The fp16/bf16 GEMV's tile per weight shape and device, and so which shapes take it: a file
`gemv_configs/{device}.json` (device name, spaces as underscores) maps "N{N}_K{K}" to {BLOCK_N,
BLOCK_K, num_warps, num_stages}, or to null where cuBLAS (F.linear) was faster at one row
(`ferrum tune`, `benchmarks/bench_gemv.py --sweep --save`). `gemv_tile` looks a shape up in the
user's folder's file (tuned_tables), then the package's; a shape neither lists takes the GEMV
with tile_rules.gemv_tile_rule's tile."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ferrum.kernels.device_properties import DeviceProperties
from ferrum.kernels.fp8_gemm_config import check_gemv_tiles
from ferrum.kernels.tile_rules import gemv_tile_rule
from ferrum.kernels.tuned_tables import tables_ignored, user_config_dir, write_table

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
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be an object of weight shapes")
    fields = {f.name for f in dataclasses.fields(GemvTile)}
    tiles: GemvTiles = {}
    for key, tile in data.items():
        match = _SHAPE_KEY.fullmatch(str(key))
        if match is None:
            raise ValueError(f"{where}: key {key!r} must read N<rows>_K<columns>")
        if tile is None:
            tiles[int(match[1]), int(match[2])] = None
            continue
        if not isinstance(tile, dict) or not set(tile) <= fields:
            raise ValueError(f"{where}[{key}]: keys must be among {sorted(fields)}")
        try:
            tiles[int(match[1]), int(match[2])] = GemvTile(**tile)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}[{key}]: {e}") from e
    return tiles


@functools.cache
def get_gemv_tiles(device_name: str, user_dir: Path | None = None) -> GemvTiles:
    """The shapes measured on this device, the package's file updated by `user_dir`'s (tuned
    tables); {} without either."""
    tiles: GemvTiles = {}
    folders = [CONFIG_DIR] + ([] if user_dir is None else [user_dir / CONFIG_DIR.name])
    for path in (config_path(device_name, folder) for folder in folders):
        if path.is_file():
            tiles |= parse_tiles(json.loads(path.read_text()), str(path))
    return tiles


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
    path = config_path(device_name, directory)
    merged = parse_tiles(json.loads(path.read_text()), str(path)) if path.is_file() else {}
    merged.update(tiles)
    merged.update(dict.fromkeys(drop))
    data = {
        f"N{n}_K{k}": None if merged[n, k] is None else dataclasses.asdict(merged[n, k])
        for n, k in sorted(merged)
    }
    write_table(path, data, sort_keys=False)
    return path
