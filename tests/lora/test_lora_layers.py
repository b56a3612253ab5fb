"""`LoRALinear` on its own, Triton kernels (interpreted on the CPU) and torch forms: a biased
merged (q/k/v) layer and a biased plain one, their weight extended with every slot's A, against
the obvious per-token definition, with a slot map longer than the batch (the runner fills every
entry, -1 past the step's tokens) and adapters of different ranks."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.interface import torch_kernels, triton_kernels
from ferrum.lora.layers import LoRABatch, LoRALinear
from ferrum.model_executor.layers.linear import Linear, MergedLinear
from ferrum.model_executor.layers.quantization.dense import DenseLinearMethod

MAX_TOKENS, SLOTS, MAX_RANK, IN = 48, 3, 8, 32


def _layer(merged: bool, batch: LoRABatch, kernels, gen: torch.Generator):  # noqa: ANN001, ANN202
    method = DenseLinearMethod(kernels)
    if merged:
        base = MergedLinear(IN, {"q": 32, "k": 16, "v": 16}, True, method)
    else:
        base = Linear(IN, 24, True, method)
    base.weight.data = torch.randn(base.output_size, IN, generator=gen) * 0.1
    base.bias.data = torch.randn(base.output_size, generator=gen)
    weight, bias = base.weight.detach().clone(), base.bias.detach().clone()
    layer = LoRALinear(base, batch, SLOTS, MAX_RANK, torch.float32)
    adapters = {}
    for slot, rank in enumerate((8, 4, 1)):
        adapters[slot] = {
            name: (
                torch.randn(rank, IN, generator=gen) * 0.3,
                torch.randn(size, rank, generator=gen),
            )
            for name, _, size, _ in layer.slices
        }
        layer.set_slot(slot, adapters[slot])
    return layer, weight, bias, adapters


def _expected(layer, weight, bias, adapters, x, slots):  # noqa: ANN001, ANN202
    y = x @ weight.t() + bias
    for i, slot in enumerate(slots.tolist()):
        for name, offset, size, _ in layer.slices if slot >= 0 else ():
            a, b = adapters[slot][name]
            y[i, offset : offset + size] += (x[i] @ a.t()) @ b.t()
    return y


@pytest.mark.parametrize("is_triton", [True, False])
@pytest.mark.parametrize("merged", [True, False])
def test_extended_layer_matches_per_token_adapters(is_triton: bool, merged: bool) -> None:
    gen = torch.Generator().manual_seed(int(is_triton) * 2 + int(merged))
    kernels = triton_kernels() if is_triton else torch_kernels()
    cpu = torch.device("cpu")
    batch = LoRABatch(MAX_TOKENS, SLOTS, cpu, is_triton, False, kernels.dense_linear)
    layer, weight, bias, adapters = _layer(merged, batch, kernels, gen)
    assert layer.weight_ext is not None and layer.bias_ext is not None
    for num_tokens, step_tokens in ((1, 1), (7, 5), (20, 20)):
        step = torch.randint(-1, SLOTS, (step_tokens,), generator=gen, dtype=torch.int32)
        batch.token_slots.fill_(-1)  # a graph's padded rows (past the step's) have no adapter
        batch.token_slots[:step_tokens] = step
        batch.regroup()
        x = torch.randn(num_tokens, IN, generator=gen)
        got = layer(x)
        expected = _expected(layer, weight, bias, adapters, x, batch.token_slots[:num_tokens])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
