"""The few-row linear (tensor cores, operands swapped, split-K) against F.linear in fp32, and its
argument checks."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.gemv_rows import MAX_ROWS, GemvRowsTile, gemv_rows

CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 runs only on CUDA")


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=CUDA_ONLY)])
@pytest.mark.parametrize(
    "m, n, k, split_k",
    [(2, 50, 100, 1), (3, 64, 128, 2), (MAX_ROWS, 40, 96, 3), (5, 16, 32, 4)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(device, dtype, m, n, k, split_k, bias) -> None:
    """Ragged N and K tiles, rows padded to MAX_ROWS, splits of several K steps ((3, 64, 128,
    2): two each), splits with none ((5, 16, 32, 4): one K step, so splits 1-3 sum nothing),
    and twice in a row (the arrival counters are reset)."""
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    tile = GemvRowsTile(BLOCK_N=16, BLOCK_K=32, SPLIT_K=split_k)
    expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    for _ in range(2):
        got = gemv_rows(x, w, tile, bias=b)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)


def test_takes_rows_of_a_wider_buffer(device) -> None:
    """x may be a view whose rows are further apart than K (stride(0) > K)."""
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 80, generator=gen).to(device, torch.float16)
    w = (torch.randn(24, 64, generator=gen) * 0.1).to(device, torch.float16)
    got = gemv_rows(wide[:, :64], w, GemvRowsTile(16, 32, 2))
    expected = torch.nn.functional.linear(wide[:, :64].float(), w.float())
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=1e-2)


def test_rejects_bad_operands_and_tiles() -> None:
    w = torch.zeros(32, 64, dtype=torch.float16)
    tile = GemvRowsTile(16, 32)
    with pytest.raises(ValueError, match="rows"):
        gemv_rows(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.float16), w, tile)
    with pytest.raises(ValueError, match="x must be"):
        gemv_rows(torch.zeros(2, 32, dtype=torch.float16), w, tile)
    with pytest.raises(ValueError, match="bias must be"):
        gemv_rows(torch.zeros(2, 64, dtype=torch.float16), w, tile, bias=torch.zeros(4))
    with pytest.raises(ValueError, match=">= 16"):
        GemvRowsTile(8, 32)
    with pytest.raises(ValueError, match="power of two"):
        GemvRowsTile(48, 32)
    with pytest.raises(ValueError, match="SPLIT_K"):
        GemvRowsTile(16, 32, SPLIT_K=0)
