"""Reading checkpoint weights: safetensors files (single or sharded), one tensor at a time, and
dispatching named tensors to the parameters' weight loaders. The checkpoint yields
`CheckpointTensor`s, read only when a loader asks; a loader that `reads_slices` (tensor-parallel
layers) narrows the tensor to its rank's part and reads only that; others get the whole tensor."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

INDEX_FILE = "model.safetensors.index.json"
# Checkpoints at least this large show a progress bar (bytes read) while loading.
PROGRESS_MIN_BYTES = 256 << 20

# Maps a checkpoint tensor name to (parameter name, shard id); None skips the tensor.
NameMapper = Callable[[str], "tuple[str, Hashable] | None"]
# Bytes per element of safetensors dtypes (any other is one byte: 8-bit types).
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}


class CheckpointTensor:
    """A tensor of an open safetensors file, read on `load()`: only the region that `narrow`
    calls left (each narrows one dim of what the previous ones left). Valid while the checkpoint
    iteration that yielded it has not moved on."""

    __slots__ = ("_file", "name", "_path", "_full_shape", "_region", "shape", "dtype_name")

    def __init__(self, handle: Any, name: str, path: str) -> None:
        self._file = handle
        self.name = name
        self._path = path
        lazy = handle.get_slice(name)
        self.shape = self._full_shape = torch.Size(lazy.get_shape())
        self.dtype_name: str = lazy.get_dtype()
        self._region: tuple[slice, ...] = tuple(slice(0, n) for n in self.shape)

    @property
    def num_bytes(self) -> int:
        return self.shape.numel() * _DTYPE_BYTES.get(self.dtype_name, 1)

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        dim = dim % self.dim()
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(
                f"cannot take [{start}, {start + length}) of dim {dim} from shape "
                f"{tuple(self.shape)}"
            )
        view = object.__new__(CheckpointTensor)
        view._file, view.name, view._path = self._file, self.name, self._path
        view._full_shape, view.dtype_name = self._full_shape, self.dtype_name
        base = self._region[dim].start
        view._region = (
            *self._region[:dim],
            slice(base + start, base + start + length),
            *self._region[dim + 1 :],
        )
        view.shape = torch.Size(length if i == dim else n for i, n in enumerate(self.shape))
        return view

    def load(self) -> torch.Tensor:
        """The region, read from the file (a CPU tensor)."""
        try:
            if self.shape == self._full_shape:
                return self._file.get_tensor(self.name)
            return self._file.get_slice(self.name)[self._region]
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise WeightFileError(
                f"weight file {self._path}: cannot read tensor {self.name!r}: {e}"
            ) from e


def materialize(loaded: torch.Tensor | CheckpointTensor) -> torch.Tensor:
    """The tensor's values: read from the file for a CheckpointTensor (or another lazy view
    with `load`, e.g. an int4 tensor in ferrum's layout)."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.load()


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
    """Iterates (name, CheckpointTensor) over a checkpoint's files in order, at most one tensor
    in memory at a time; `current_file` names the file being read. Large checkpoints show a
    progress bar (bytes of the tensors passed over, read or not)."""

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
                    num_bytes = min(tensor.num_bytes, left)
                    left -= num_bytes
                    bar.update(num_bytes)
                    yield name, tensor
                bar.update(left)  # the file's header
        self.current_file = None


def iterate_safetensors_file(path: str) -> Iterator[tuple[str, CheckpointTensor]]:
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except (SafetensorError, OSError, RuntimeError, ValueError) as e:
        raise WeightFileError(f"weight file {path} is corrupt or unreadable: {e}") from e
    with handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open handles are not iterable)
            try:
                tensor = CheckpointTensor(handle, name, path)
            except (SafetensorError, OSError, RuntimeError, ValueError) as e:
                raise WeightFileError(
                    f"weight file {path}: cannot read tensor {name!r}: {e}"
                ) from e
            yield name, tensor


def load_named_weights(
    params: dict[str, nn.Parameter],
    weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]],
    map_name: NameMapper,
) -> set[str]:
    """Loads each checkpoint tensor into the parameter (and shard) `map_name` gives: the lazy
    tensor itself to a loader that `reads_slices`, its values to any other. Returns the names of
    the parameters whose shards (`param.shard_ids`) were all covered. Unknown tensors, shard
    errors and shape mismatches raise ValueError naming the tensor and the parameter."""
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
        view = getattr(param, "checkpoint_view", None)
        if view is not None:  # the checkpoint's layout seen as the parameter's
            tensor = view(tensor)
        if not getattr(param, "reads_slices", False):
            tensor = materialize(tensor)
        try:
            keys = param.weight_loader(param, tensor, shard_id)  # type: ignore[attr-defined]
        except WeightFileError:
            raise
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
