"""Where tuned tile tables are read, in this order: the user's folder (`ferrum tune` writes it;
DeviceConfig.tuned_config_dir, default ~/.cache/ferrum/tuned_configs, set once per process by the
model runner through `set_user_config_dir`), then the tables shipped beside these modules; with
neither, the tile rules (tile_rules, fp8_gemm_rule, fused_moe_rule) choose. Both folders share one
layout: `<folder>/{fp8_gemm_configs,fused_moe_configs,gemv_configs}/<file>`, the same file names
and the same JSON. FERRUM_DEBUG_IGNORE_TUNED_TABLES=1 skips both folders (`tables_ignored`)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

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
