"""The fp16/bf16 GEMV's tile per weight shape and device, and so which shapes take it: a file
`gemv_configs/{device}.json` (device name, spaces as underscores) maps "N{N}_K{K}" to {BLOCK_N,
BLOCK_K, num_warps, num_stages}, listing only shapes where the GEMV beat cuBLAS at one row
(`benchmarks/bench_gemv.py --sweep --save`); other shapes and devices keep torch's F.linear."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ferrum.kernels.fp8_gemm_config import check_gemv_tiles

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


GemvTiles = dict[tuple[int, int], GemvTile]


def config_path(device_name: str, directory: Path | None = None) -> Path:
    return (CONFIG_DIR if directory is None else directory) / (
        device_name.replace(" ", "_") + ".json"
    )


def parse_tiles(data: object, where: str) -> GemvTiles:
    """Validates {"N<n>_K<k>": {GemvTile fields}}."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be an object of weight shapes")
    fields = {f.name for f in dataclasses.fields(GemvTile)}
    tiles: GemvTiles = {}
    for key, tile in data.items():
        match = _SHAPE_KEY.fullmatch(str(key))
        if match is None:
            raise ValueError(f"{where}: key {key!r} must read N<rows>_K<columns>")
        if not isinstance(tile, dict) or not set(tile) <= fields:
            raise ValueError(f"{where}[{key}]: keys must be among {sorted(fields)}")
        try:
            tiles[int(match[1]), int(match[2])] = GemvTile(**tile)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}[{key}]: {e}") from e
    return tiles


@functools.cache
def get_gemv_tiles(device_name: str) -> GemvTiles:
    """The shapes that take the GEMV on this device, with their tiles (none without a file)."""
    path = config_path(device_name)
    if not path.is_file():
        return {}
    return parse_tiles(json.loads(path.read_text()), str(path))


def save_gemv_tiles(
    device_name: str,
    tiles: GemvTiles,
    directory: Path | None = None,
    drop: frozenset[tuple[int, int]] = frozenset(),
) -> Path:
    """Writes `tiles` as the device's file, replacing the shapes it names, removing the shapes
    in `drop` (measured, and slower than cuBLAS) and keeping the others already there."""
    path = config_path(device_name, directory)
    merged = parse_tiles(json.loads(path.read_text()), str(path)) if path.is_file() else {}
    merged = {shape: tile for shape, tile in merged.items() if shape not in drop}
    merged.update(tiles)
    data = {f"N{n}_K{k}": dataclasses.asdict(merged[n, k]) for n, k in sorted(merged)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
