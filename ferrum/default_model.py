"""The small model shipped inside the package: the default of every CLI command."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "ferrum-tiny-qwen3"
DEFAULT_MODEL_DIR = str(Path(__file__).parent / "model_files" / DEFAULT_MODEL_NAME)
