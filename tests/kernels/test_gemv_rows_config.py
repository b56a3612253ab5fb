"""The few-row kernel's tuned table: its buckets, file format (null: F.linear), merging, and what
the engine takes when no table lists a shape (F.linear: there is no rule)."""

from __future__ import annotations

import json

import pytest

from ferrum.kernels import gemv_rows_config
from ferrum.kernels.device_properties import DeviceProperties
from ferrum.kernels.gemv_rows import MAX_ROWS, GemvRowsTile
from ferrum.kernels.gemv_rows_config import (
    gemv_rows_tile,
    get_gemv_rows_tiles,
    parse_rows_tiles,
    row_bucket,
    save_gemv_rows_tiles,
)


def test_rows_take_the_smallest_bucket_that_holds_them() -> None:
    assert [row_bucket(m) for m in (2, 3, 4, 5, 8, 9, MAX_ROWS)] == [2, 4, 4, 8, 8, 16, 16]
    for rows in (1, MAX_ROWS + 1):
        with pytest.raises(ValueError, match="rows"):
            row_bucket(rows)


def test_file_round_trip_keeps_other_entries(tmp_path) -> None:
    first = {(4096, 4096, 4): GemvRowsTile(64, 256, 2), (6144, 4096, 4): GemvRowsTile(128, 128)}
    save_gemv_rows_tiles("Some GPU", first, tmp_path)
    second = {(4096, 4096, 4): GemvRowsTile(64, 128, 4), (6144, 4096, 8): None}
    path = save_gemv_rows_tiles("Some GPU", second, tmp_path)
    assert path.name == "Some_GPU.json"
    data = json.loads(path.read_text())
    assert data["N4096_K4096_M4"]["SPLIT_K"] == 4 and data["N6144_K4096_M8"] is None
    assert parse_rows_tiles(data, "x")[6144, 4096, 4] == GemvRowsTile(128, 128)


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "must be an object"),
        ({"N1_K2": {"BLOCK_N": 64, "BLOCK_K": 64}}, "must read"),
        ({"N1_K2_M3": {"BLOCK_N": 64, "BLOCK_K": 64}}, "must read"),
        ({"N1_K2_M4": {"BLOCK_N": 64, "BLOCK_K": 64, "rows": 4}}, "keys must be among"),
        ({"N1_K2_M4": {"BLOCK_N": 8, "BLOCK_K": 64}}, ">= 16"),
        ({"N1_K2_M4": 7}, "keys must be among"),
    ],
)
def test_bad_files_are_refused_naming_the_entry(data, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_rows_tiles(data, "table.json")


def test_lookup_by_bucket_user_folder_first_and_no_rule(tmp_path, monkeypatch) -> None:
    device = DeviceProperties("Some GPU", 132, 232448, (9, 0), 50 << 20, 4.8e12)
    monkeypatch.setattr(gemv_rows_config, "CONFIG_DIR", tmp_path / "package")
    get_gemv_rows_tiles.cache_clear()
    save_gemv_rows_tiles("Some GPU", {(64, 32, 4): GemvRowsTile(16, 32)}, tmp_path / "package")
    user = tmp_path / "user"
    user_tiles = {(64, 32, 4): GemvRowsTile(32, 32, 2), (64, 64, 2): None}
    save_gemv_rows_tiles("Some GPU", user_tiles, user / "package")
    save_gemv_rows_tiles("Some GPU", {(64, 64, 2): GemvRowsTile(16, 32)}, tmp_path / "package")
    monkeypatch.setattr(gemv_rows_config, "user_config_dir", lambda: user)
    try:
        assert gemv_rows_tile(64, 32, 3, device) == GemvRowsTile(32, 32, 2)
        assert gemv_rows_tile(64, 32, 5, device) is None  # bucket 8: not listed
        assert gemv_rows_tile(64, 32, 1, device) is None  # one row: the GEMV's table
        assert gemv_rows_tile(64, 64, 4, device) is None  # another shape: F.linear
        assert gemv_rows_tile(64, 64, 2, device) is None  # the user's null hides the package's
    finally:
        get_gemv_rows_tiles.cache_clear()
