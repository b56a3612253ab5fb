from __future__ import annotations

import pytest
import torch

from ferrum.kernels.fp8_quant import Fp8GroupRows, per_token_group_quant_fp8
from ferrum.kernels.fp8_quant_ref import per_token_group_quant_fp8_ref
from ferrum.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_fp8,
    rms_norm,
    rms_norm_fp8,
)
from ferrum.kernels.rms_norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from tests.utils.fp8_inputs import cuda_only

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(*shape, generator=gen)).to(device, dtype)
    residual = torch.randn(*shape, generator=gen).to(device, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device, dtype)
    return x, residual, weight


@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 130), (1, 1000)])
def test_rms_norm_matches_reference(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    x, _, weight = _inputs(shape, dtype, device)
    out = rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), **TOL[dtype])


def test_rms_norm_strided_rows_and_given_out(device: torch.device) -> None:
    x, _, weight = _inputs((5, 160), torch.float32, device, seed=1)
    view = x[:, :80]  # row stride 160
    out = torch.full((5, 80), float("nan"), device=device)
    got = rms_norm(view, weight[:80].contiguous(), 1e-5, out=out)
    assert got is out
    torch.testing.assert_close(out, rms_norm_ref(view, weight[:80], 1e-5), **TOL[torch.float32])


@pytest.mark.parametrize("shape", [(6, 64), (2, 3, 200)])
def test_fused_add_rms_norm_matches_reference(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    x, residual, weight = _inputs(shape, dtype, device, seed=2)
    expected_out, expected_res = fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    fused_add_rms_norm(x, residual, weight, 1e-6)
    # The sum is one rounding of an exact fp32 add: bit-equal to torch's.
    torch.testing.assert_close(residual, expected_res, atol=0, rtol=0)
    torch.testing.assert_close(x, expected_out, **TOL[dtype])


def test_validation_errors() -> None:
    x, residual, weight = _inputs((4, 32), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight[:16], 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, weight.half(), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, weight, 0.0)
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, weight, 1e-6, out=torch.empty(4, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="x must be"):
        rms_norm(x.t().contiguous().t(), weight, 1e-6)
    with pytest.raises(ValueError, match="x dtype"):
        rms_norm(x.double(), weight.double(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, residual[:2], weight, 1e-6)
    with pytest.raises(ValueError, match="x leading dims"):
        fused_add_rms_norm(torch.zeros(4, 3, 32)[:, :2], torch.zeros(4, 2, 32), weight, 1e-6)


def _assert_rows_quantize(rows: Fp8GroupRows, out: torch.Tensor) -> None:
    """The FP8 rows are the per-token-group quantization of the stored output, bit for bit (the
    separate pass runs the same conversion, so this holds under the CPU interpreter too)."""
    q, scales = per_token_group_quant_fp8(out.reshape(-1, out.shape[-1]))
    assert rows.q.dtype == torch.float8_e4m3fn and rows.q.is_contiguous()
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(rows.scales, scales, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(5, 256), (2, 3, 384), (1, 640)])
def test_rms_norm_fp8_rows(shape: tuple[int, ...], device: torch.device) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    x, _, weight = _inputs(shape, dtype, device, seed=3)
    out, rows = rms_norm_fp8(x, weight, 1e-6)
    # The sum of squares may be added in another order (the row is held as groups).
    torch.testing.assert_close(out, rms_norm(x, weight, 1e-6), **TOL[dtype])
    _assert_rows_quantize(rows, out)


@pytest.mark.parametrize("shape", [(6, 128), (3, 1152)])
def test_fused_add_rms_norm_fp8_rows(shape: tuple[int, ...], device: torch.device) -> None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    x, residual, weight = _inputs(shape, dtype, device, seed=4)
    x2, residual2 = x.clone(), residual.clone()
    rows = fused_add_rms_norm_fp8(x, residual, weight, 1e-6)
    fused_add_rms_norm(x2, residual2, weight, 1e-6)
    torch.testing.assert_close(residual, residual2, rtol=0, atol=0)
    torch.testing.assert_close(x, x2, **TOL[dtype])
    _assert_rows_quantize(rows, x)


@cuda_only
def test_rms_norm_fp8_rows_match_torch_reference() -> None:
    x, _, weight = _inputs((9, 4096), torch.bfloat16, torch.device("cuda"), seed=5)
    out, rows = rms_norm_fp8(x, weight, 1e-6)
    q, scales = per_token_group_quant_fp8_ref(out)
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    torch.testing.assert_close(rows.scales, scales, rtol=0, atol=0)


def test_fp8_rows_validation_errors() -> None:
    x, residual, weight = _inputs((4, 192), torch.float16, torch.device("cpu"))
    with pytest.raises(ValueError, match="multiple of 128"):
        rms_norm_fp8(x, weight, 1e-6)
    x, residual, weight = _inputs((4, 256), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="fp16/bf16"):
        fused_add_rms_norm_fp8(x, residual, weight, 1e-6)
