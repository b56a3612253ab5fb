"""Which few-row linears take the Triton kernel (gemv_rows.py) instead of cuBLAS, and with which
tile: a file `gemv_rows_configs/{device}.json` (device name, spaces as underscores) maps
"N{N}_K{K}_M{bucket}" to {BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages}, or to null where
cuBLAS was measured faster; a batch of m rows (2 <= m <= MAX_ROWS) looks up the smallest bucket of
ROW_BUCKETS >= m (`ferrum tune --ops gemv_rows`, `benchmarks/bench_gemv_rows.py --save`). There is
no rule: a shape no table lists runs F.linear. The user's folder's file (tuned_tables) updates
the package's."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

from ferrum.kernels.device_properties import DeviceProperties
from ferrum.kernels.gemv_rows import MAX_ROWS, GemvRowsTile
from ferrum.kernels.tuned_tables import tables_ignored, user_config_dir, write_table

CONFIG_DIR = Path(__file__).parent / "gemv_rows_configs"
ROW_BUCKETS = (2, 4, 8, MAX_ROWS)
_KEY = re.compile(r"N(\d+)_K(\d+)_M(\d+)")

# (N, K, bucket) -> tile, or None where F.linear was measured faster
GemvRowsTiles = dict[tuple[int, int, int], GemvRowsTile | None]


def row_bucket(rows: int) -> int:
    """The table bucket of a batch of `rows` (2..MAX_ROWS) rows."""
    return next(b for b in ROW_BUCKETS if b >= rows)


def config_path(device_name: str, directory: Path | None = None) -> Path:
    return (CONFIG_DIR if directory is None else directory) / (
        device_name.replace(" ", "_") + ".json"
    )


def parse_rows_tiles(data: object, where: str) -> GemvRowsTiles:
    """Validates {"N<n>_K<k>_M<bucket>": {GemvRowsTile fields} or null}."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be an object of weight shapes and row buckets")
    fields = {f.name for f in dataclasses.fields(GemvRowsTile)}
    tiles: GemvRowsTiles = {}
    for key, tile in data.items():
        match = _KEY.fullmatch(str(key))
        if match is None or int(match[3]) not in ROW_BUCKETS:
            raise ValueError(f"{where}: key {key!r} must read N<rows>_K<columns>_M<{ROW_BUCKETS}>")
        if tile is None:
            tiles[int(match[1]), int(match[2]), int(match[3])] = None
            continue
        if not isinstance(tile, dict) or not set(tile) <= fields:
            raise ValueError(f"{where}[{key}]: keys must be among {sorted(fields)}")
        try:
            tiles[int(match[1]), int(match[2]), int(match[3])] = GemvRowsTile(**tile)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}[{key}]: {e}") from e
    return tiles


@functools.cache
def get_gemv_rows_tiles(device_name: str, user_dir: Path | None = None) -> GemvRowsTiles:
    """The entries measured on this device, the package's file updated by `user_dir`'s."""
    tiles: GemvRowsTiles = {}
    folders = [CONFIG_DIR] + ([] if user_dir is None else [user_dir / CONFIG_DIR.name])
    for path in (config_path(device_name, folder) for folder in folders):
        if path.is_file():
            tiles |= parse_rows_tiles(json.loads(path.read_text()), str(path))
    return tiles


def gemv_rows_tile(n: int, k: int, rows: int, device: DeviceProperties) -> GemvRowsTile | None:
    """The tile `rows` (2..MAX_ROWS) rows times an [N, K] weight run with on `device`; None
    (F.linear) where no table lists the shape at that bucket."""
    if tables_ignored() or not 2 <= rows <= MAX_ROWS:
        return None
    return get_gemv_rows_tiles(device.name, user_config_dir()).get((n, k, row_bucket(rows)))


def save_gemv_rows_tiles(
    device_name: str, tiles: GemvRowsTiles, directory: Path | None = None
) -> Path:
    """Writes `tiles` into the device's file (None: F.linear), replacing the entries they name
    and keeping the others."""
    path = config_path(device_name, directory)
    merged = parse_rows_tiles(json.loads(path.read_text()), str(path)) if path.is_file() else {}
    merged.update(tiles)
    data = {
        f"N{n}_K{k}_M{m}": None if tile is None else dataclasses.asdict(tile)
        for (n, k, m), tile in sorted(merged.items())
    }
    write_table(path, data, sort_keys=False)
    return path
