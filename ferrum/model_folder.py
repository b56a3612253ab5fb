"""The JSON files of a local model folder: config.json and generation_config.json."""

from __future__ import annotations

import json
import os
from typing import Any

from ferrum.config_fields import field_error as _fail
from ferrum.gguf.config import read_gguf_config
from ferrum.gguf.reader import is_gguf_path


def read_hf_config(model: str) -> dict[str, Any]:
    """Reads `config.json` from a local Hugging Face model folder (or the config of a GGUF file,
    from its metadata)."""
    if is_gguf_path(model):
        try:
            return read_gguf_config(model)
        except (ValueError, ImportError) as e:
            raise _fail("model", str(e)) from e
    if not os.path.isdir(model):
        raise _fail("model", f"{model!r} is not a local model folder (no model hub is used)")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise _fail("model", f"{model!r} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise _fail("model", f"cannot read {path}: {e}") from e
    if not isinstance(config, dict):
        raise _fail("model", f"{path} does not hold a JSON object")
    return config


def read_generation_config(model: str, generation_config: str) -> dict[str, Any]:
    """generation_config.json of the model folder ("auto", "vllm") or of the folder given; {}
    when the model folder has none or it is unreadable."""
    folder = model if generation_config in ("auto", "vllm") else generation_config
    path = os.path.join(folder, "generation_config.json")
    if folder != model and not os.path.isfile(path):
        message = "is not a folder holding a generation_config.json (use auto, vllm, or one)"
        raise _fail("generation_config", f"{generation_config!r} {message}")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return config if isinstance(config, dict) else {}
