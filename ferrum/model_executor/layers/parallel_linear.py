"""Tensor-parallel linear layers, one class per way of splitting a weight over the ranks. Column
parallel: each rank holds a block of output rows, no communication (the merged variants split each
projection on its own: every rank's matrix is again [gate_r; up_r] or [q_r; k_r; v_r]). Row
parallel: each rank holds a block of input columns; partial outputs are all-reduced, bias added
once. With one rank these are exactly `Linear` / `MergedLinear`. Loaders `reads_slices`: only the
rank's block is read from the file. Block scales narrow in 128-blocks, so each share must start
and end on block boundaries (else a ValueError); per-channel scales split with the output rows."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ferrum.distributed.parallel_state import TensorParallelGroup
from ferrum.model_executor.layers.linear import (
    Linear,
    MergedLinear,
    default_weight_loader,
    set_weight_loader,
)
from ferrum.model_executor.weight_loader import CheckpointTensor, materialize

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows

_SINGLE = TensorParallelGroup()


def split_evenly(size: int, world_size: int, what: str) -> int:
    """size / world_size, or a ValueError naming `what` when it does not divide."""
    if size % world_size:
        raise ValueError(f"{what}: {size} is not divisible by tensor_parallel_size={world_size}")
    return size // world_size


def _reads_slices(param: nn.Parameter | None) -> None:
    if param is not None:
        param.reads_slices = True  # type: ignore[attr-defined]


def _rows(
    loaded: torch.Tensor | CheckpointTensor, dim: int, start: int, length: int
) -> torch.Tensor:
    """Rows [start, start + length) of `loaded` along `dim`, read (only those) from the file."""
    return materialize(loaded.narrow(dim, start, length))


def _in_blocks(
    param: nn.Parameter, start: int, length: int, what: str, attr: str = "output_block"
) -> tuple[int, int]:
    """(start, length) of weight rows (`output_block`) or columns (`input_block`) in `param`'s
    entries (blocks for block scales, words of packed int4 codes)."""
    block = getattr(param, attr, getattr(param, "output_block", 1))
    if block > 1 and start % block:
        raise ValueError(
            f"{what}: this rank's share starts at {start}, inside a {block}-wide block "
            f"(a quantized layer's shares must start on {block}-row/column boundaries)"
        )
    return start // block, -(-length // block)


class MergedColumnParallelLinear(MergedLinear):
    """Several column-parallel projections of the same input in one matrix (e.g. gate, up):
    rank r holds block r of each projection, stacked in `shard_sizes` order."""

    def __init__(
        self,
        input_size: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        tp_group: TensorParallelGroup | None = None,
        **linear_kwargs: Any,
    ) -> None:
        group = tp_group or _SINGLE
        local_sizes = {
            name: split_evenly(size, group.world_size, f"{name} size")
            for name, size in shard_sizes.items()
        }
        # shard id -> (start, length) of this rank's rows in the checkpoint tensor.
        self.checkpoint_rows = {
            name: (group.rank * size, size) for name, size in local_sizes.items()
        }
        super().__init__(input_size, local_sizes, bias, **linear_kwargs)
        self.tp_group = group
        if group.world_size > 1:
            for param in self.parameters(recurse=False):
                _reads_slices(param)

    def _load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor, shard_id: Hashable
    ) -> set[Hashable]:
        if self.tp_group.world_size > 1 and shard_id in self.checkpoint_rows:
            start, length = self.checkpoint_rows[shard_id]  # type: ignore[index]
            start, length = _in_blocks(param, start, length, f"shard {shard_id!r}")
            loaded = _rows(loaded, 0, start, length)
        return super()._load_shard(param, loaded, shard_id)


class QKVParallelLinear(MergedColumnParallelLinear):
    """The fused q, k, v projection split by heads: each rank gets num_heads / tp query heads
    and num_kv_heads / tp KV heads, or, when tp > num_kv_heads, one KV head (head
    r * num_kv_heads // tp, shared by the tp / num_kv_heads ranks whose query heads use it)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_group: TensorParallelGroup | None = None,
        **linear_kwargs: Any,
    ) -> None:
        group = tp_group or _SINGLE
        tp = group.world_size
        self.num_heads = split_evenly(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = split_evenly(num_kv_heads, tp, "num_key_value_heads")
            first_kv_head = group.rank * self.num_kv_heads
        elif tp % num_kv_heads == 0:
            self.num_kv_heads = 1
            first_kv_head = group.rank * num_kv_heads // tp
        else:
            raise ValueError(
                f"num_key_value_heads: tensor_parallel_size={tp} must divide {num_kv_heads} or "
                "be a multiple of it"
            )
        q_size = self.num_heads * head_dim
        kv_size = self.num_kv_heads * head_dim
        # Built as if unsplit (tp 1) with the local sizes, then pointed at the rank's rows.
        sizes = {"q": q_size, "k": kv_size, "v": kv_size}
        super().__init__(hidden_size, sizes, bias, **linear_kwargs)
        self.tp_group = group
        self.checkpoint_rows = {
            "q": (group.rank * q_size, q_size),
            "k": (first_kv_head * head_dim, kv_size),
            "v": (first_kv_head * head_dim, kv_size),
        }
        if tp > 1:
            for param in self.parameters(recurse=False):
                _reads_slices(param)


class RowParallelLinear(Linear):
    """y = sum over ranks of x_r W_r^T, + b: rank r holds input columns [r * n, (r + 1) * n),
    n = input / tp, and gets x_r, its slice of the input (a column-parallel layer's output).
    The bias is held whole by every rank and added after the all-reduce."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_group: TensorParallelGroup | None = None,
        **linear_kwargs: Any,
    ) -> None:
        group = tp_group or _SINGLE
        local = split_evenly(input_size, group.world_size, "input size")
        self.full_input_size = input_size  # read by quant methods while creating weights
        super().__init__(local, output_size, bias, **linear_kwargs)
        self.tp_group = group
        if group.world_size > 1:
            for param in self.parameters(recurse=False):
                # The bias and per-channel scales [N, 1] cover every input column: whole on
                # each rank; the weight and block scales split by columns.
                blocked = getattr(param, "input_block", getattr(param, "output_block", 1)) > 1
                if param is getattr(self, "weight", None) or blocked:
                    set_weight_loader(param, self._load_rank_columns)
                    _reads_slices(param)

    def _load_rank_columns(
        self, param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor, shard_id: Hashable
    ) -> set[Hashable]:
        local = self.input_size
        start, n = _in_blocks(
            param, self.tp_group.rank * local, local, "input columns", "input_block"
        )
        return default_weight_loader(param, _rows(loaded, 1, start, n), shard_id)

    def forward(self, x: torch.Tensor, x_fp8: Fp8GroupRows | None = None) -> torch.Tensor:
        if self.tp_group.world_size == 1:
            return super().forward(x, x_fp8)
        if self.quant_method is not None:
            partial = self.quant_method.apply(self, x, None, x_fp8)
        elif x_fp8 is not None:
            raise ValueError("x_fp8: a model-dtype layer takes no FP8 rows")
        else:
            partial = torch.nn.functional.linear(x, self.weight)
        out = self.tp_group.all_reduce(partial)
        return out if self.bias is None else out + self.bias
