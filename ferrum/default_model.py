"""The small model shipped inside the package: the default of every CLI command."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "ferrum-tiny-qwen3"
DEFAULT_MODEL_DIR = str(Path(__file__).parent / "model_files" / DEFAULT_MODEL_NAME)


def resolve_model(model: str | None) -> str:
    """The model folder: `model` itself, or the shipped model's folder for None or its name."""
    if model is None or (model == DEFAULT_MODEL_NAME and not os.path.isdir(model)):
        return DEFAULT_MODEL_DIR
    return model
