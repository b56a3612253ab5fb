"""Int4 experts of a FusedMoE layer (GPTQ, AWQ, compressed-tensors pack-quantized), dequantized
to the model dtype once loaded: the fused-MoE kernels have no int4 path yet, so the experts take
the model dtype's memory (4x the int4 bytes in bf16), and start-up says so. Loading reads the
checkpoint's per-expert tensors in ferrum's int4 layout (int4_checkpoint.py) into stacked
parameters `w13_<name>` [E, 2I, ...] (gate rows, then up) and `w2_<name>` [E, H, ...]; then
`w13` / `w2` replace them. Act-order experts are refused (config.py), so the experts' g_idx and
compressed-tensors' weight_shape tensors are skipped by name (qwen3_moe.map_expert_name)."""

from __future__ import annotations

import torch
from torch import nn

from ferrum.kernels.int4_ref import NIBBLES, SYMMETRIC_ZERO, dequantize_int4, pack_int4
from ferrum.kernels.interface import Kernels
from ferrum.logger import init_logger
from ferrum.model_executor.layers.linear import quantized_parameter
from ferrum.model_executor.layers.quantization.base import GeneratorFor
from ferrum.model_executor.layers.quantization.int4_checkpoint import checkpoint_view
from ferrum.quant_config import QuantConfig

logger = init_logger(__name__)
_logged = False


class Int4MoEMethod:
    def __init__(self, quant_config: QuantConfig, kernels: Kernels, layer_name: str) -> None:
        assert quant_config.int4 is not None
        self.scheme = quant_config.int4
        self.layer_name = layer_name
        gptq_like = self.scheme.layout in ("gptq", "gptq_v2", "awq")
        self.names = {
            "packed": "qweight" if gptq_like else "weight_packed",
            "scale": quant_config.scale_name,
            **({"zero": "qzeros"} if self.scheme.has_zero else {}),
        }
        self._kernel = kernels.fused_moe
        self.groups: dict[str, int] = {}

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int
    ) -> None:
        """Stacked int4 parameters of both projections; FusedMoE sets their loaders."""
        shapes = {
            "w13": (2 * intermediate_size, hidden_size),
            "w2": (hidden_size, intermediate_size),
        }
        for proj, (rows, cols) in shapes.items():
            full = cols if self.scheme.group_size == -1 else self.scheme.group_size
            if cols % NIBBLES or cols % full:
                raise ValueError(
                    f"quantization: int4 experts {self.layer_name}: {proj}'s {cols} input "
                    f"columns (on this rank) must be a multiple of 8 and of the group size {full}"
                )
            self.groups[proj] = full
            group_block = None if self.scheme.group_size == -1 else full
            words = torch.empty(num_experts, rows, cols // NIBBLES, dtype=torch.int32)
            zeros = torch.empty(num_experts, rows, cols // full, dtype=torch.uint8)
            made = {
                "packed": quantized_parameter(words, input_block=NIBBLES),
                "scale": quantized_parameter(
                    torch.empty(num_experts, rows, cols // full), input_block=group_block
                ),
                "zero": quantized_parameter(zeros, input_block=group_block),
            }
            for key, name in self.names.items():
                made[key].checkpoint_view = checkpoint_view(self.scheme.layout, name)  # type: ignore[attr-defined]
                setattr(layer, f"{proj}_{name}", made[key])

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        global _logged
        dtype = torch.get_default_dtype()
        for proj in ("w13", "w2"):
            packed = getattr(layer, f"{proj}_{self.names['packed']}")
            scale = getattr(layer, f"{proj}_{self.names['scale']}")
            zero = getattr(layer, f"{proj}_{self.names['zero']}") if "zero" in self.names else None
            experts = torch.empty(*packed.shape[:2], packed.shape[2] * NIBBLES, dtype=scale.dtype,
                                  device=packed.device)  # fmt: skip
            for e in range(packed.shape[0]):
                z = None if zero is None else zero[e]
                experts[e] = dequantize_int4(packed[e], scale[e], z, None, self.groups[proj])
            for name in self.names.values():
                delattr(layer, f"{proj}_{name}")
            setattr(layer, proj, nn.Parameter(experts.to(dtype), requires_grad=False))
        if not _logged:
            _logged = True
            name = str(dtype).removeprefix("torch.")
            logger.warning(
                "int4 experts (%s and the other MoE layers) are dequantized to %s at load: the "
                "fused-MoE kernels have no int4 path yet, so the experts take %s's memory",
                self.layer_name, name, name,
            )  # fmt: skip

    def fill_dummy_weights(self, layer: nn.Module, std: float, generator: GeneratorFor) -> None:
        """Uniform codes 1..15 (mean 8, std ~4.3) and scales giving the weights std `std`."""
        for proj in ("w13", "w2"):
            packed = getattr(layer, f"{proj}_{self.names['packed']}")
            shape = (*packed.shape[:2], packed.shape[2] * NIBBLES)
            gen = generator(packed.device)
            codes = torch.randint(1, 16, shape, generator=gen, device=packed.device)
            packed.data.copy_(pack_int4(codes))
            getattr(layer, f"{proj}_{self.names['scale']}").data.fill_(std / 4.3)
            if "zero" in self.names:
                getattr(layer, f"{proj}_{self.names['zero']}").data.fill_(SYMMETRIC_ZERO)

    def apply(
        self,
        layer: nn.Module,
        hidden: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:
        """The model-dtype experts (dequantized at load) through the fused-MoE kernels."""
        return self._kernel(hidden, layer.w13, layer.w2, topk_weights, topk_ids)
