from __future__ import annotations

import pytest
import torch

from ferrum.kernels.activation import silu_and_mul, silu_and_mul_fp8
from ferrum.kernels.activation_ref import silu_and_mul_ref
from ferrum.kernels.fp8_quant import per_token_group_quant_fp8

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.mark.parametrize(("num_tokens", "inter"), [(5, 48), (3, 1100), (1, 7)])
def test_silu_and_mul_matches_reference(
    num_tokens: int, inter: int, dtype: torch.dtype, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(inter)
    x = (4 * torch.randn(num_tokens, 2 * inter, generator=gen)).to(device, dtype)
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), **TOL[dtype])


def test_strided_input_and_given_out(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 100, generator=gen).to(device)
    x = wide[:, :60]  # row stride 100
    out = torch.full((4, 30), float("nan"), device=device)
    assert silu_and_mul(x, out=out) is out
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[torch.float32])


def test_validation_errors() -> None:
    with pytest.raises(ValueError, match="x must be"):
        silu_and_mul(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="x must be"):
        silu_and_mul(torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be"):
        silu_and_mul(torch.zeros(8, 4).t())
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul(torch.zeros(3, 8), out=torch.zeros(3, 8))


@pytest.mark.parametrize(("num_tokens", "inter"), [(5, 128), (3, 1152), (2, 2048)])
def test_silu_and_mul_fp8_rows(num_tokens: int, inter: int, device: torch.device) -> None:
    """The FP8 rows are the per-token-group quantization of the output, bit for bit (the separate
    pass runs the same conversion, so this holds under the CPU interpreter too)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    gen = torch.Generator().manual_seed(inter)
    x = (4 * torch.randn(num_tokens, 2 * inter, generator=gen)).to(device, dtype)
    out, rows = silu_and_mul_fp8(x)
    torch.testing.assert_close(out, silu_and_mul(x), rtol=0, atol=0)
    q, scales = per_token_group_quant_fp8(out)
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(rows.scales, scales, rtol=0, atol=0)


def test_silu_and_mul_fp8_validation_errors() -> None:
    with pytest.raises(ValueError, match="multiple of 128"):
        silu_and_mul_fp8(torch.zeros(2, 2 * 96, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp16/bf16"):
        silu_and_mul_fp8(torch.zeros(2, 256))
