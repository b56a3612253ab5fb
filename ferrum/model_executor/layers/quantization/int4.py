"""W4A16 int4 linear layers (GPTQ, AWQ, compressed-tensors pack-quantized): the weights in
ferrum's layout (kernels/int4_ref.py) under the checkpoint's own parameter names, each converted
from the checkpoint's layout as it loads (int4_checkpoint.py); the product is `kernels.int4_linear`
(Triton on CUDA, the torch reference elsewhere)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.kernels.int4_ref import NIBBLES, SYMMETRIC_ZERO, pack_int4
from ferrum.kernels.interface import Kernels
from ferrum.model_executor.layers.linear import quantized_parameter, set_weight_loader
from ferrum.model_executor.layers.quantization.base import GeneratorFor
from ferrum.model_executor.layers.quantization.int4_checkpoint import checkpoint_view
from ferrum.model_executor.weight_loader import CheckpointTensor, materialize
from ferrum.quant_config import QuantConfig

if TYPE_CHECKING:
    from ferrum.kernels.fp8_quant import Fp8GroupRows


class Int4LinearMethod:
    def __init__(self, quant_config: QuantConfig, kernels: Kernels, layer_name: str) -> None:
        assert quant_config.int4 is not None
        self.scheme = quant_config.int4
        self.layer_name = layer_name
        gptq_like = self.scheme.layout in ("gptq", "gptq_v2", "awq")
        self.packed_name = "qweight" if gptq_like else "weight_packed"
        self.scale_name = quant_config.scale_name
        self.zero_name = "qzeros" if self.scheme.has_zero else None
        self.g_idx_name = None
        if self.scheme.layout in ("gptq", "gptq_v2"):
            self.g_idx_name = "g_idx"  # GPTQ checkpoints carry one, act-order or not
        elif self.scheme.act_order:
            self.g_idx_name = "weight_g_idx"
        self.shape_name = None if gptq_like else "weight_shape"
        self._linear = kernels.int4_linear
        self.group_size = 0  # per layer: K for per-channel (group_size -1)

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        group = input_size if self.scheme.group_size == -1 else self.scheme.group_size
        if input_size % NIBBLES or input_size % group:
            raise ValueError(
                f"quantization: int4 layer {self.layer_name} has {input_size} input columns "
                f"(on this rank): they must be a multiple of 8 and of the group size {group}"
            )
        self.group_size = group
        groups = input_size // group
        dtype = torch.get_default_dtype()
        scale_block = None if self.scheme.group_size == -1 else group
        if self.scheme.act_order:
            # g_idx picks any group for any column: every rank holds every group's scales
            # (a row-parallel layer's columns are split, its groups are not).
            groups = getattr(layer, "full_input_size", input_size) // group
            scale_block = None
        params = {
            self.packed_name: quantized_parameter(
                torch.empty(output_size, input_size // NIBBLES, dtype=torch.int32),
                input_block=NIBBLES,
            ),
            self.scale_name: quantized_parameter(
                torch.empty(output_size, groups, dtype=dtype), input_block=scale_block
            ),
        }
        if self.zero_name:
            zero = torch.empty(output_size, groups, dtype=torch.uint8)
            params[self.zero_name] = quantized_parameter(zero, input_block=scale_block)
        for name, param in params.items():
            param.checkpoint_view = checkpoint_view(self.scheme.layout, name)  # type: ignore[attr-defined]
            setattr(layer, name, param)
        if self.g_idx_name:
            g_idx = quantized_parameter(torch.arange(input_size, dtype=torch.int32) // group)

            def load_g_idx(param: nn.Parameter, loaded: object, shard_id: Hashable) -> set:
                return self._load_g_idx(layer, param, loaded, shard_id)  # type: ignore[arg-type]

            self._own_loader(layer, self.g_idx_name, g_idx, load_g_idx)
        if self.shape_name:
            shape = quantized_parameter(torch.tensor([output_size, input_size]))
            self._own_loader(layer, self.shape_name, shape, lambda p, t, s: {s})

    def _own_loader(self, layer: nn.Module, name: str, param: nn.Parameter, loader) -> None:  # noqa: ANN001
        """A parameter every shard of a merged layer loads whole: kept by the layers' loaders;
        dummy weights keep its initial value (the identity grouping, the shape)."""
        param.same_for_every_shard = True  # type: ignore[attr-defined]
        set_weight_loader(param, loader)
        setattr(layer, name, param)

    def _load_g_idx(
        self,
        layer: nn.Module,
        param: nn.Parameter,
        loaded: torch.Tensor | CheckpointTensor,
        shard_id: Hashable,
    ) -> set[Hashable]:
        """The rank's columns of g_idx (a row-parallel layer's share; others take it whole)."""
        values = materialize(loaded).to(torch.int32)
        if not self.scheme.act_order:
            group = self.scheme.group_size if self.scheme.group_size != -1 else len(values)
            if not torch.equal(values, torch.arange(len(values), dtype=torch.int32) // group):
                raise ValueError(
                    "g_idx permutes the input columns among the groups, but the checkpoint's "
                    "quantization_config says desc_act is false"
                )
            return {shard_id}
        local = param.shape[0]
        if len(values) != local and len(values) % local == 0 and hasattr(layer, "tp_group"):
            values = values[layer.tp_group.rank * local : (layer.tp_group.rank + 1) * local]
        if values.shape != param.shape:
            raise ValueError(
                f"g_idx: expected shape {tuple(param.shape)}, got {tuple(values.shape)}"
            )
        if getattr(param, "filled", False) and not torch.equal(param.data.cpu(), values):
            raise ValueError("the projections of one merged layer have different g_idx")
        param.data.copy_(values)
        param.filled = True  # type: ignore[attr-defined]
        return {shard_id}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        return None

    def fill_dummy_weights(self, layer: nn.Module, std: float, generator: GeneratorFor) -> None:
        """Uniform codes 1..15 (mean 8, std ~4.3) and scales giving the weights std `std`."""
        packed = getattr(layer, self.packed_name)
        gen = generator(packed.device)
        codes = torch.randint(1, 16, (packed.shape[0], packed.shape[1] * NIBBLES),
                              generator=gen, device=packed.device)  # fmt: skip
        packed.data.copy_(pack_int4(codes))
        getattr(layer, self.scale_name).data.fill_(std / 4.3)
        if self.zero_name:
            getattr(layer, self.zero_name).data.fill_(SYMMETRIC_ZERO)

    def takes_fp8_rows(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return False

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        x_fp8: Fp8GroupRows | None = None,
    ) -> torch.Tensor:
        if x_fp8 is not None:
            raise ValueError("x_fp8: an int4 layer takes no FP8 rows")
        zero = getattr(layer, self.zero_name) if self.zero_name else None
        g_idx = getattr(layer, self.g_idx_name) if self.scheme.act_order else None
        packed, scale = getattr(layer, self.packed_name), getattr(layer, self.scale_name)
        return self._linear(x, packed, scale, zero, g_idx, self.group_size, bias)
