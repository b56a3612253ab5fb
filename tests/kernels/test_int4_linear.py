"""The W4A16 kernel against its torch reference (symmetric, zero points, act-order g_idx, bias),
each row independent of the batch, and the packing helpers against hand-packed words."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.int4_linear import int4_linear
from ferrum.kernels.int4_ref import dequantize_int4, int4_linear_ref, pack_int4, unpack_int4


def test_pack_and_unpack_follow_the_nibble_order() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15]])
    word = sum(c << (4 * i) for i, c in enumerate(codes[0].tolist()))
    assert pack_int4(codes).item() == word - (1 << 32)  # nibble 7 = 15 sets the sign bit
    assert torch.equal(unpack_int4(pack_int4(codes)), codes.int())
    # AWQ's order: nibble i holds code order[i].
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    awq_word = sum(codes[0, order[i]].item() << (4 * i) for i in range(8))
    awq = torch.tensor([[awq_word - (1 << 32)]], dtype=torch.int32)
    assert torch.equal(unpack_int4(awq, order), codes.int())


def weights(n: int, k: int, group: int, zeros: bool, act_order: bool, dtype: torch.dtype):  # noqa: ANN201
    gen = torch.Generator().manual_seed(n + k + group)
    groups = k // group
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).to(dtype)
    zero = torch.randint(0, 16, (n, groups), generator=gen).to(torch.uint8) if zeros else None
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)].int()
    return pack_int4(codes), scale, zero, g_idx


@pytest.mark.parametrize(
    ("k", "group", "zeros", "act_order"),
    [(256, 64, False, False), (256, 32, True, False), (256, 64, True, True), (72, 24, True, False)],
)
def test_kernel_matches_the_reference_and_rows_do_not_depend_on_the_batch(
    k: int, group: int, zeros: bool, act_order: bool, dtype: torch.dtype, device: torch.device
) -> None:
    # K 72: a tail of 8 columns past the last 64-wide K step (masked loads there).
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("bf16 runs only on CUDA")
    n = 80
    packed, scale, zero, g_idx = (
        t.to(device) if t is not None else None
        for t in weights(n, k, group, zeros, act_order, dtype)
    )
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, k, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    got = int4_linear(x, packed, scale, zero, g_idx, group, bias)
    expected = int4_linear_ref(x.float(), packed, scale, zero, g_idx, group, bias.float())
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), expected, **tol)
    for subset in ([0], [36], [3, 4, 5], list(range(36, -1, -2))):
        assert torch.equal(
            int4_linear(x[subset], packed, scale, zero, g_idx, group, bias), got[subset]
        )
    w = dequantize_int4(packed, scale, zero, g_idx, group)
    assert w.shape == (n, k)
