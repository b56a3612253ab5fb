"""Linear layers, plain and merged (qkv, gate_up), and the parameter loading protocol: every
parameter carries `weight_loader(param, tensor, shard_id) -> covered shard keys` and `shard_ids`
(all must be covered before it counts as loaded). A `quant_method` makes the weights (e.g. FP8
codes and scales) and runs the GEMM; a parameter whose rows each cover `output_block` output rows
loads a merged shard into rows offset // block."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from itertools import accumulate
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows
    from ferrum.model_executor.layers.quantization.base import LinearMethod

WeightLoader = Callable[[nn.Parameter, torch.Tensor, Hashable], set[Hashable]]


def set_weight_loader(
    param: nn.Parameter, loader: WeightLoader, shard_ids: frozenset[Hashable] = frozenset({None})
) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.shard_ids = shard_ids  # type: ignore[attr-defined]


def check_shape(expected: torch.Size, found: torch.Size, what: str = "") -> None:
    if tuple(expected) != tuple(found):
        where = f" for {what}" if what else ""
        raise ValueError(f"expected shape {tuple(expected)}{where}, found {tuple(found)}")


def _dtype_name(t: object) -> str:
    """float8_e4m3fn, bfloat16, ...; a lazy checkpoint tensor's safetensors name (F8_E4M3)."""
    dtype = getattr(t, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else str(t.dtype_name)  # type: ignore[attr-defined]


def check_dtype(param: nn.Parameter, loaded: object) -> None:
    """FP8 codes load only into FP8 parameters and vice versa: casting between them without the
    scales would load wrong values silently. `loaded`: a tensor or a lazy checkpoint tensor."""
    fp8_names = ("float8_e4m3fn", "F8_E4M3")
    if (param.dtype == torch.float8_e4m3fn) != (_dtype_name(loaded) in fp8_names):
        found, wanted = _dtype_name(loaded), _dtype_name(param)
        raise ValueError(
            f"checkpoint dtype {found} for a {wanted} parameter: the checkpoint's "
            "quantized modules differ from what its quantization_config (and ignore list) says"
        )


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None
) -> set[Hashable]:
    """Copies a whole checkpoint tensor into `param` (converting dtype and device)."""
    if shard_id is not None:
        raise ValueError(f"parameter takes no shard, got shard {shard_id!r}")
    check_shape(param.shape, loaded.shape)
    check_dtype(param, loaded)
    param.data.copy_(loaded)
    return {None}


def new_parameter(*shape: int) -> nn.Parameter:
    """Uninitialised inference parameter in the current default dtype and device, loaded whole
    by `default_weight_loader` (a layer with shards sets its own loader)."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    set_weight_loader(param, default_weight_loader)
    return param


def quantized_parameter(
    data: torch.Tensor, output_block: int = 1, input_block: int | None = None
) -> nn.Parameter:
    """A parameter of a quantized format: loaded whole (layers that split weights set their own
    loaders), `output_block` weight rows and `input_block` weight columns an entry (block
    scales, packed codes, groups; the layers' splits read them), and filled by the method's
    `fill_dummy_weights` rather than the generic random initialisation."""
    param = nn.Parameter(data, requires_grad=False)
    set_weight_loader(param, default_weight_loader)
    param.output_block = output_block  # type: ignore[attr-defined]
    if input_block is not None:
        param.input_block = input_block  # type: ignore[attr-defined]
    param.dummy_by_layer = True  # type: ignore[attr-defined]
    return param


class Linear(nn.Module):
    """y = x W^T + b with W: [output_size, input_size], in the model dtype or in the format of
    `quant_method` (which then creates the weight parameters and runs the product)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.quant_method = quant_method
        if quant_method is None:
            self.weight = new_parameter(output_size, input_size)
        else:
            quant_method.create_weights(self, input_size, output_size)
        self.bias = new_parameter(output_size) if bias else None

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether `forward(x, x_fp8)` would read FP8 rows of x (LinearMethod.takes_fp8_rows)."""
        return self.quant_method is not None and self.quant_method.takes_fp8_rows(self, x)

    def forward(self, x: torch.Tensor, x_fp8: Fp8GroupRows | None = None) -> torch.Tensor:
        """`x_fp8`: x's rows quantized per token-group of 128, where `takes_fp8_rows(x)`."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias, x_fp8)
        if x_fp8 is not None:
            raise ValueError("x_fp8: a model-dtype layer takes no FP8 rows")
        return torch.nn.functional.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stored as one matrix, row blocks in `shard_sizes`
    order (e.g. q, k, v or gate, up). The checkpoint's separate tensors load into their block.
    """

    def __init__(
        self,
        input_size: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        quant_method: LinearMethod | None = None,
    ) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias, quant_method)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets = dict(zip(shard_sizes, accumulate(shard_sizes.values(), initial=0)))
        shard_ids = frozenset(shard_sizes)
        for param in self.parameters(recurse=False):
            if getattr(param, "same_for_every_shard", False):  # loaded whole by its own loader
                param.shard_ids = shard_ids  # type: ignore[attr-defined]
            else:
                set_weight_loader(param, self._load_shard, shard_ids)

    def _load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable
    ) -> set[Hashable]:
        if shard_id not in self.shard_sizes:
            raise ValueError(
                f"unknown shard {shard_id!r}; expected one of {list(self.shard_sizes)}"
            )
        size, offset = self.shard_sizes[shard_id], self.shard_offsets[shard_id]
        block = getattr(param, "output_block", 1)
        if offset % block:
            raise ValueError(
                f"shard {shard_id!r} starts at output row {offset}, inside a {block}-row scale "
                f"block: merged shards must start on {block}-row boundaries"
            )
        target = param.data.narrow(0, offset // block, -(-size // block))
        check_shape(target.shape, loaded.shape, f"shard {shard_id!r}")
        check_dtype(param, loaded)
        target.copy_(loaded)
        return {shard_id}
