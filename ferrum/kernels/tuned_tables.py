"""Where tuned tile tables are read, in this order: the user's folder (`ferrum tune` writes it;
DeviceConfig.tuned_config_dir, default ~/.cache/ferrum/tuned_configs, set once per process by the
model runner through `set_user_config_dir`), then the tables shipped beside these modules; with
neither, the tile rules (tile_rules, fp8_gemm_rule, fused_moe_rule) choose. Both folders share one
layout: `<folder>/{fp8_gemm,fused_moe,gemv,gemv_rows}_configs/<file>`, the same file names
and the same JSON. FERRUM_DEBUG_IGNORE_TUNED_TABLES=1 skips both folders (`tables_ignored`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ferrum import envs


class _UserFolder:
    """The process's user table folder (None: none is read). Set at start-up, before the first
    forward; the table caches key on it, so a later change is seen, never mixed."""

    path: Path | None = None


def set_user_config_dir(path: Path | str | None) -> None:
    """Makes `path` the user table folder of this process (None: read the packaged tables only)."""
    _UserFolder.path = None if path is None else Path(path)


def user_config_dir() -> Path | None:
    return _UserFolder.path


@functools.cache
def tables_ignored() -> bool:
    """Whether this process reads no tuned table (envs.debug_ignore_tuned_tables), rules only."""
    return envs.debug_ignore_tuned_tables()


def tuned_file(package_dir: Path, file_name: str, user_dir: Path | None) -> Path | None:
    """The file that holds this table, first found wins: `user_dir/<package_dir's name>/
    file_name`, then `package_dir/file_name`; None when neither exists."""
    paths = [package_dir / file_name]
    if user_dir is not None:
        paths.insert(0, user_dir / package_dir.name / file_name)
    return next((p for p in paths if p.is_file()), None)


def write_table(path: Path, data: object, sort_keys: bool = True) -> None:
    """Writes `data` as indented JSON to `path` (folders made) through a temporary file renamed
    over it, so a reader or an interrupted writer never sees half a table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")
    tmp.replace(path)


# A shape table's entries: the key's integers (e.g. (N, K)) -> a tile dataclass, or None where
# cuBLAS (F.linear) was measured faster.
ShapeTable = dict[tuple[int, ...], Any]


def parse_shape_table(
    data: object, where: str, key: re.Pattern[str], key_form: str, tile_type: type
) -> ShapeTable:
    """Validates a JSON object of `key`-shaped names (described as `key_form` in errors) to
    `tile_type`'s fields or null; a ValueError names the file (`where`) and the entry."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be an object of weight shapes")
    fields = {f.name for f in dataclasses.fields(tile_type)}
    table: ShapeTable = {}
    for name, tile in data.items():
        match = key.fullmatch(str(name))
        if match is None:
            raise ValueError(f"{where}: key {name!r} must read {key_form}")
        entry = tuple(int(g) for g in match.groups())
        if tile is None:
            table[entry] = None
            continue
        if not isinstance(tile, dict) or not set(tile) <= fields:
            raise ValueError(f"{where}[{name}]: keys must be among {sorted(fields)}")
        try:
            table[entry] = tile_type(**tile)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}[{name}]: {e}") from e
    return table


def read_shape_tables(
    package_dir: Path,
    file_name: str,
    user_dir: Path | None,
    parse: Callable[[object, str], Mapping[Any, Any]],
) -> ShapeTable:
    """The package's table updated by the user folder's (`user_dir/<package_dir's name>/`);
    {} without either."""
    table: ShapeTable = {}
    folders = [package_dir] + ([] if user_dir is None else [user_dir / package_dir.name])
    for path in (folder / file_name for folder in folders):
        if path.is_file():
            table |= parse(json.loads(path.read_text()), str(path))
    return table


def update_shape_table(
    path: Path,
    updates: Mapping[Any, Any],
    parse: Callable[[object, str], Mapping[Any, Any]],
    key_name: Callable[[Any], str],
) -> Path:
    """Writes the table at `path` with `updates` replacing the entries they name and the others
    kept, in key order (None: null)."""
    table = dict(parse(json.loads(path.read_text()), str(path))) if path.is_file() else {}
    table.update(updates)
    data = {
        key_name(entry): None if tile is None else dataclasses.asdict(tile)
        for entry, tile in sorted(table.items())
    }
    write_table(path, data, sort_keys=False)
    return path
