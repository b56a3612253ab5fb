"""Picks each linear layer's weight format when the model is built (see base.LinearMethod)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ferrum.kernels.interface import Kernels
from ferrum.model_executor.layers.quantization.base import LinearMethod
from ferrum.model_executor.layers.quantization.dense import DenseLinearMethod
from ferrum.quant_config import QuantConfig

if TYPE_CHECKING:
    from ferrum.model_executor.layers.quantization.fp8_moe import Fp8MoEMethod
    from ferrum.model_executor.layers.quantization.int4_moe import Int4MoEMethod


def _quantized(quant_config: QuantConfig, module_names: Sequence[str]) -> bool:
    """Whether the modules loaded into one layer are quantized; all of them or none must be."""
    ignored = [quant_config.is_ignored(name) for name in module_names]
    if all(ignored):
        return False
    if any(ignored):
        kept = [name for name, skip in zip(module_names, ignored) if skip]
        listed = list(module_names[:4]) + (
            [f"... ({len(module_names)} in all)"] * (len(module_names) > 4)
        )
        raise ValueError(
            f"quantization: {listed} are fused into one layer, but only {kept[:4]} "
            f"({len(kept)} in all) are in the checkpoint's ignore list (a fused layer has one "
            "weight format)"
        )
    return True


def get_linear_method(
    quant_config: QuantConfig | None, kernels: Kernels, module_names: Sequence[str]
) -> LinearMethod:
    """The method of a linear layer that loads the checkpoint modules `module_names` (one, or
    each shard of a merged layer: q_proj, k_proj, v_proj). Unquantized layers keep the model
    dtype (DenseLinearMethod)."""
    if quant_config is None or not _quantized(quant_config, module_names):
        return DenseLinearMethod(kernels)
    if quant_config.int4 is not None:
        from ferrum.model_executor.layers.quantization.int4 import Int4LinearMethod

        return Int4LinearMethod(quant_config, kernels, "/".join(module_names))
    from ferrum.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    return Fp8LinearMethod(quant_config, kernels, "/".join(module_names))


def get_moe_method(
    quant_config: QuantConfig | None, kernels: Kernels, prefix: str, num_experts: int
) -> Fp8MoEMethod | Int4MoEMethod | None:
    """The experts' method of the MoE block `prefix` ("model.layers.0.mlp"); None keeps them in
    the model dtype. Every expert projection must agree."""
    names = [
        f"{prefix}.experts.{e}.{proj}_proj"
        for e in range(num_experts)
        for proj in ("gate", "up", "down")
    ]
    if quant_config is None or not _quantized(quant_config, names):
        return None
    if quant_config.int4 is not None:
        from ferrum.model_executor.layers.quantization.int4_moe import Int4MoEMethod

        return Int4MoEMethod(quant_config, kernels, f"{prefix}.experts")
    from ferrum.model_executor.layers.quantization.fp8_moe import Fp8MoEMethod

    return Fp8MoEMethod(quant_config, kernels, f"{prefix}.experts")
