"""Which few-row linears take the Triton kernel (gemv_rows.py) instead of cuBLAS, and with which
tile: a file `gemv_rows_configs/{device}.json` (device name, spaces as underscores) maps
"N{N}_K{K}_M{bucket}" to {BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages}, or to null where
cuBLAS was measured faster; a batch of m rows (2 <= m <= MAX_ROWS) looks up the smallest bucket of
ROW_BUCKETS >= m (`ferrum tune --ops gemv_rows`, `benchmarks/bench_gemv_rows.py --save`). There is
no rule: a shape no table lists runs F.linear. The user's folder's file (tuned_tables) updates
the package's."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import cast

from ferrum.kernels.device_properties import DeviceProperties
from ferrum.kernels.gemv_rows import MAX_ROWS, GemvRowsTile
from ferrum.kernels.tuned_tables import (
    parse_shape_table,
    read_shape_tables,
    tables_ignored,
    update_shape_table,
    user_config_dir,
)

CONFIG_DIR = Path(__file__).parent / "gemv_rows_configs"
ROW_BUCKETS = (2, 4, 8, MAX_ROWS)
_KEY = re.compile(r"N(\d+)_K(\d+)_M(\d+)")

# (N, K, bucket) -> tile, or None where F.linear was measured faster
GemvRowsTiles = dict[tuple[int, int, int], GemvRowsTile | None]


def row_bucket(rows: int) -> int:
    """The table bucket of a batch of `rows` (2..MAX_ROWS) rows."""
    if not 2 <= rows <= MAX_ROWS:
        raise ValueError(f"rows: the few-row kernel's tables hold 2..{MAX_ROWS} rows, got {rows}")
    return next(b for b in ROW_BUCKETS if b >= rows)


def config_path(device_name: str, directory: Path | None = None) -> Path:
    return (CONFIG_DIR if directory is None else directory) / (
        device_name.replace(" ", "_") + ".json"
    )


def parse_rows_tiles(data: object, where: str) -> GemvRowsTiles:
    """Validates {"N<n>_K<k>_M<bucket>": {GemvRowsTile fields} or null}."""
    form = f"N<rows>_K<columns>_M<{ROW_BUCKETS}>"
    tiles = parse_shape_table(data, where, _KEY, form, GemvRowsTile)
    for n, k, bucket in tiles:
        if bucket not in ROW_BUCKETS:
            raise ValueError(f"{where}: key 'N{n}_K{k}_M{bucket}' must read {form}")
    return cast(GemvRowsTiles, tiles)


@functools.cache
def get_gemv_rows_tiles(device_name: str, user_dir: Path | None = None) -> GemvRowsTiles:
    """The entries measured on this device, the package's file updated by `user_dir`'s."""
    file_name = config_path(device_name).name
    return cast(GemvRowsTiles, read_shape_tables(CONFIG_DIR, file_name, user_dir, parse_rows_tiles))


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
    return update_shape_table(path, tiles, parse_rows_tiles, lambda e: "N{}_K{}_M{}".format(*e))
