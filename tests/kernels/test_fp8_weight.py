from __future__ import annotations

import pytest
import torch

from ferrum.kernels.fp8_quant import FP8_MAX
from ferrum.kernels.fp8_weight import (
    dequantize_weight_block,
    dequantize_weight_per_channel,
    quantize_weight_block,
    quantize_weight_per_channel,
)

FP8 = torch.float8_e4m3fn


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (64, 128)])
def test_block_quantize_matches_per_block_loop(n: int, k: int) -> None:
    w = _weight(n, k)
    q, scale_inv = quantize_weight_block(w)
    assert q.dtype == FP8 and q.shape == (n, k) and q.is_contiguous()
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (-(-n // 128), -(-k // 128))
    for bi in range(scale_inv.shape[0]):
        for bk in range(scale_inv.shape[1]):
            tile = w[bi * 128 : (bi + 1) * 128, bk * 128 : (bk + 1) * 128]
            s = tile.abs().max() / FP8_MAX
            assert scale_inv[bi, bk] == s
            codes = q[bi * 128 : (bi + 1) * 128, bk * 128 : (bk + 1) * 128]
            assert torch.equal(codes.float(), (tile / s).to(FP8).float())
    back = dequantize_weight_block(q, scale_inv)
    assert ((back - w).abs() <= w.abs() / 16 + 2.0**-9 * scale_inv.max()).all()


def test_block_dequantize_uses_the_block_of_each_entry() -> None:
    q = torch.ones(130, 260).to(FP8)
    scale_inv = torch.arange(1.0, 7.0).view(2, 3)
    back = dequantize_weight_block(q, scale_inv, dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16
    assert back[127, 127] == 1 and back[128, 0] == 4 and back[0, 256] == 3 and back[129, 259] == 6


def test_custom_block_shape() -> None:
    w = _weight(96, 64, seed=1)
    q, scale_inv = quantize_weight_block(w, block=(32, 64))
    assert scale_inv.shape == (3, 1)
    torch.testing.assert_close(
        dequantize_weight_block(q, scale_inv, block=(32, 64)), w, rtol=1 / 16, atol=1e-3
    )


def test_per_channel_round_trip() -> None:
    w = _weight(48, 100, seed=2).bfloat16()
    q, scale = quantize_weight_per_channel(w)
    assert q.shape == (48, 100) and scale.shape == (48, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale[:, 0], w.float().abs().amax(1) / FP8_MAX, rtol=0, atol=0)
    assert torch.equal(q.float().abs().amax(1), torch.full((48,), FP8_MAX))
    back = dequantize_weight_per_channel(q, scale, dtype=torch.float32)
    assert ((back - w.float()).abs() <= w.float().abs() / 16 + scale * 2.0**-9).all()
    torch.testing.assert_close(dequantize_weight_per_channel(q, scale[:, 0]), back)


def test_zero_block_dequantizes_to_zero() -> None:
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    q, scale_inv = quantize_weight_block(w)
    assert torch.equal(dequantize_weight_block(q, scale_inv), w)


def test_validation_errors() -> None:
    w = _weight(128, 128)
    with pytest.raises(ValueError, match="weight must be"):
        quantize_weight_block(w.to(FP8))
    with pytest.raises(ValueError, match="weight must be"):
        quantize_weight_per_channel(w[0])
    with pytest.raises(ValueError, match="block must be"):
        quantize_weight_block(w, block=(128, 0))
    q, scale_inv = quantize_weight_block(w)
    with pytest.raises(ValueError, match=r"scale_inv must be \[1, 1\]"):
        dequantize_weight_block(q, scale_inv.repeat(2, 1))
    with pytest.raises(ValueError, match="scale must be"):
        dequantize_weight_per_channel(q, torch.ones(64, 1))
