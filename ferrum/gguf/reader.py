"""An opened GGUF file: its metadata fields and tensors, read with the `gguf` library.

Every read the library makes is bounds-checked here, so a truncated or malformed file is a
ValueError naming the file (never a short array, an IndexError or an unbounded loop).
"""

from __future__ import annotations

import functools
import os
from typing import Any

GGUF_SUFFIX = ".gguf"
_INSTALL_HINT = "reading GGUF files needs the gguf library: pip install ferrum[gguf]"
# What a malformed file makes the library raise while parsing.
_PARSE_ERRORS = (ValueError, IndexError, KeyError, OverflowError, TypeError, UnicodeDecodeError)
_MISSING: Any = object()


def is_gguf_path(model: str) -> bool:
    """Whether `model` names a GGUF file (by its suffix; it need not exist)."""
    return str(model).lower().endswith(GGUF_SUFFIX)


def import_gguf() -> Any:
    """The `gguf` module, or an ImportError saying how to install it."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    return gguf


class GGUFFile:
    """Metadata (`field`) and tensors (`tensors`: the library's ReaderTensor list) of one file."""

    def __init__(self, path: str) -> None:
        self.path = path
        reader_class = _checked_reader_class()
        try:
            reader = reader_class(path)
        except OSError as e:
            raise ValueError(f"GGUF file {path}: cannot read it: {e}") from e
        except _PARSE_ERRORS as e:
            raise ValueError(f"GGUF file {path} is truncated or malformed: {e}") from e
        self.tensors = reader.tensors
        self._fields = reader.fields

    def has(self, key: str) -> bool:
        return key in self._fields

    def field(self, key: str, kind: type = str, default: Any = _MISSING) -> Any:
        """Metadata `key` as `kind` (str, int, float, bool or list); `default` when absent, else a
        ValueError naming the key and the file."""
        entry = self._fields.get(key)
        if entry is None:
            if default is _MISSING:
                raise ValueError(f"GGUF file {self.path}: metadata {key} is missing")
            return default
        try:
            value = entry.contents()
        except _PARSE_ERRORS as e:
            raise ValueError(f"GGUF file {self.path}: metadata {key} is unreadable: {e}") from e
        if kind is list:
            ok = isinstance(value, list)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise ValueError(
                f"GGUF file {self.path}: metadata {key} must be a {kind.__name__}, "
                f"got {value!r:.80}"
            )
        return float(value) if kind is float else value

    def keys_with_prefix(self, prefix: str) -> list[str]:
        return [key for key in self._fields if key.startswith(prefix)]


def open_gguf(path: str) -> GGUFFile:
    """The parsed file at `path`, shared by the callers of one process while it is unchanged."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path} does not exist (or is not a file)")
    stat = os.stat(path)
    return _open_cached(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int) -> GGUFFile:
    del mtime_ns, size  # cache keys only: a rewritten file is parsed again
    return GGUFFile(path)


@functools.cache
def _checked_reader_class() -> type:
    """The library's GGUFReader whose one read primitive refuses reads past the end of the file
    (the library returns short arrays there, and loops over counts read from the file)."""
    gguf = import_gguf()

    class CheckedReader(gguf.GGUFReader):  # type: ignore[misc,name-defined]
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            values = super()._get(offset, dtype, count, override_order)
            if len(values) != int(count):
                raise ValueError(
                    f"needs {int(count)} values at byte {offset}, the file ends before them"
                )
            return values

    return CheckedReader
