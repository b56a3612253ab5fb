"""Reading checkpoint weights: safetensors files (single or sharded), one tensor at a time, and
dispatching named tensors to the parameters' weight loaders."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Hashable, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"
# Checkpoints at least this large show a progress bar (bytes read) while loading.
PROGRESS_MIN_BYTES = 256 << 20

# Maps a checkpoint tensor name to (parameter name, shard id); None skips the tensor.
NameMapper = Callable[[str], "tuple[str, Hashable] | None"]


class WeightFileError(ValueError):
    """A weight file is missing, unreadable or corrupt (the message names the file)."""


def list_safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's files: those named by `model.safetensors.index.json` when present,
    else every `*.safetensors` in the folder. Raises WeightFileError when none or one is missing."""
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise WeightFileError(f"cannot read weight index {index_path}: {e!r}") from e
        files = [os.path.join(model_dir, name) for name in names]
        for path in files:
            if not os.path.isfile(path):
                raise WeightFileError(f"weight file {path} named in {index_path} is missing")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise WeightFileError(f"no *.safetensors weight files in {model_dir}")
    return files


class SafetensorsCheckpoint:
    """Iterates (name, cpu tensor) over a checkpoint's files in order, one tensor in memory at a
    time; `current_file` names the file being read. Large checkpoints show a progress bar."""

    def __init__(self, model_dir: str) -> None:
        self.files = list_safetensors_files(model_dir)
        self.current_file: str | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        total = sum(os.path.getsize(path) for path in self.files)
        with tqdm(
            total=total,
            desc="Loading weights",
            unit="B",
            unit_scale=True,
            disable=total < PROGRESS_MIN_BYTES,
        ) as bar:
            for path in self.files:
                self.current_file = path
                left = os.path.getsize(path)
                for name, tensor in iterate_safetensors_file(path):
                    num_bytes = min(tensor.numel() * tensor.element_size(), left)
                    left -= num_bytes
                    bar.update(num_bytes)
                    yield name, tensor
                bar.update(left)  # the file's header
        self.current_file = None


def iterate_safetensors_file(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise WeightFileError(f"weight file {path} is corrupt or unreadable: {e}") from e
    with handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            try:
                tensor = handle.get_tensor(name)
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                raise WeightFileError(
                    f"weight file {path}: cannot read tensor {name!r}: {e}"
                ) from e
            yield name, tensor


def load_named_weights(
    params: dict[str, nn.Parameter],
    weights: Iterable[tuple[str, torch.Tensor]],
    map_name: NameMapper,
) -> set[str]:
    """Loads each checkpoint tensor into the parameter (and shard) `map_name` gives. Returns the
    names of the parameters whose shards (`param.shard_ids`) were all covered. Unknown tensors,
    shard errors and shape mismatches raise ValueError naming the tensor and the parameter."""
    covered: dict[str, set[Hashable]] = {}
    for ckpt_name, tensor in weights:
        target = map_name(ckpt_name)
        if target is None:
            continue
        param_name, shard_id = target
        param = params.get(param_name)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} matches no model parameter "
                f"(looked for {param_name!r})"
            )
        try:
            keys = param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
        except ValueError as e:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} -> parameter {param_name!r}: {e}"
            ) from e
        covered.setdefault(param_name, set()).update(keys)
    return {
        name
        for name, keys in covered.items()
        if keys >= params[name].shard_ids  # type: ignore[attr-defined]
    }
