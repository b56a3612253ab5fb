"""Linear layers, plain and merged (fused qkv / gate_up), and the parameter loading protocol.

Every parameter made here carries `weight_loader(param, tensor, shard_id) -> covered shard keys`
and `shard_ids` (the keys that must all be covered before the parameter counts as loaded).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from itertools import accumulate

import torch
from torch import nn

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


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable = None
) -> set[Hashable]:
    """Copies a whole checkpoint tensor into `param` (converting dtype and device)."""
    if shard_id is not None:
        raise ValueError(f"parameter takes no shard, got shard {shard_id!r}")
    check_shape(param.shape, loaded.shape)
    param.data.copy_(loaded)
    return {None}


def new_parameter(*shape: int) -> nn.Parameter:
    """Uninitialised inference parameter in the current default dtype and device, loaded whole
    by `default_weight_loader` (a layer with shards sets its own loader)."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    set_weight_loader(param, default_weight_loader)
    return param


class Linear(nn.Module):
    """y = x W^T + b with W: [output_size, input_size]."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = new_parameter(output_size, input_size)
        self.bias = new_parameter(output_size) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input stored as one matrix, row blocks in `shard_sizes`
    order (e.g. q, k, v or gate, up). The checkpoint's separate tensors load into their block.
    """

    def __init__(self, input_size: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets = dict(zip(shard_sizes, accumulate(shard_sizes.values(), initial=0)))
        shard_ids = frozenset(shard_sizes)
        set_weight_loader(self.weight, self._load_shard, shard_ids)
        if self.bias is not None:
            set_weight_loader(self.bias, self._load_shard, shard_ids)

    def _load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Hashable
    ) -> set[Hashable]:
        if shard_id not in self.shard_sizes:
            raise ValueError(
                f"unknown shard {shard_id!r}; expected one of {list(self.shard_sizes)}"
            )
        size = self.shard_sizes[shard_id]
        target = param.data.narrow(0, self.shard_offsets[shard_id], size)
        check_shape(target.shape, loaded.shape, f"shard {shard_id!r}")
        target.copy_(loaded)
        return {shard_id}
