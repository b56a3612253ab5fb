"""Int4 checkpoint tensors seen in ferrum's layout (kernels/int4_ref.py), lazily: a view has
ferrum's shape, narrows in ferrum's coordinates (the tensor-parallel and merged-layer loaders do)
and reads only the matching region of the checkpoint tensor, converting it on `load`.

Checkpoint layouts, per linear layer of N outputs and K inputs, G = K / group_size groups:
- GPTQ: qweight int32 [K/8, N] (8 codes along K a word), scales [G, N], qzeros int32 [G, N/8]
  (8 along N; format "gptq" stores zero - 1), g_idx [K].
- AWQ (GEMM): qweight int32 [K, N/8] and qzeros [G, N/8], 8 along N in the order AWQ_ORDER;
  scales [G, N].
- compressed-tensors pack-quantized: weight_packed int32 [N, K/8] (codes + 8 of signed values),
  weight_scale [N, G], weight_g_idx [K], weight_shape."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferrum.kernels.int4_ref import pack_int4, unpack_int4
from ferrum.model_executor.weight_loader import CheckpointTensor, materialize

# AWQ's packing: nibble i of a word holds output column 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Per ferrum dim: (checkpoint dim, numerator, denominator) mapping a start or length.
DimMap = tuple[tuple[int, int, int], ...]


class Int4View:
    """A checkpoint tensor (lazy or loaded) as ferrum's layout; see the module docstring."""

    def __init__(
        self,
        source: torch.Tensor | CheckpointTensor,
        shape: tuple[int, ...],
        dims: DimMap,
        convert: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.source, self.shape, self.dims, self.convert = source, torch.Size(shape), dims, convert
        self.name = getattr(source, "name", "")
        dtype = getattr(source, "dtype", None)  # check_dtype's question: FP8 or not
        self.dtype_name = getattr(source, "dtype_name", str(dtype).removeprefix("torch."))

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> Int4View:
        dim = dim % self.dim()
        source_dim, num, den = self.dims[dim]
        if (start * num) % den or (length * num) % den:
            raise ValueError(
                f"cannot take [{start}, {start + length}) of dim {dim} of a packed int4 tensor: "
                f"the checkpoint packs {den} entries a word there"
            )
        source = self.source.narrow(source_dim, start * num // den, length * num // den)
        shape = tuple(length if i == dim else n for i, n in enumerate(self.shape))
        return Int4View(source, shape, self.dims, self.convert)

    def load(self) -> torch.Tensor:
        return self.convert(materialize(self.source))


def _transposed(source: torch.Tensor | CheckpointTensor) -> Int4View:
    rows, cols = source.shape
    return Int4View(source, (cols, rows), ((1, 1, 1), (0, 1, 1)), lambda t: t.t().contiguous())


def _zeros_along_n(
    source: torch.Tensor | CheckpointTensor, order: tuple[int, ...] | None, offset: int
) -> Int4View:
    """qzeros [G, N/8] -> uint8 [N, G] (+ offset, modulo 16)."""
    groups, words = source.shape

    def convert(t: torch.Tensor) -> torch.Tensor:
        return ((unpack_int4(t, order) + offset) & 0xF).t().contiguous().to(torch.uint8)

    return Int4View(source, (words * 8, groups), ((1, 1, 8), (0, 1, 1)), convert)


def _awq_qweight(source: torch.Tensor | CheckpointTensor) -> Int4View:
    """[K, N/8] along N in AWQ_ORDER -> [N, K/8] along K."""
    k, words = source.shape

    def convert(t: torch.Tensor) -> torch.Tensor:
        return pack_int4(unpack_int4(t, AWQ_ORDER).t().contiguous())

    return Int4View(source, (words * 8, k // 8), ((1, 1, 8), (0, 8, 1)), convert)


def _as_is(source: torch.Tensor | CheckpointTensor) -> Int4View:
    dims = tuple((d, 1, 1) for d in range(len(source.shape)))
    return Int4View(source, tuple(source.shape), dims, lambda t: t)


def checkpoint_view(layout: str, suffix: str) -> Callable[..., Int4View]:
    """The view of a checkpoint tensor named `<module>.<suffix>` in `layout`."""
    if layout in ("gptq", "gptq_v2"):
        offset = 1 if layout == "gptq" else 0
        views = {
            "qweight": _transposed,
            "scales": _transposed,
            "qzeros": lambda s: _zeros_along_n(s, None, offset),
        }
    elif layout == "awq":
        views = {
            "qweight": _awq_qweight,
            "scales": _transposed,
            "qzeros": lambda s: _zeros_along_n(s, AWQ_ORDER, 0),
        }
    else:
        views = {}
    return views.get(suffix, _as_is)
