from __future__ import annotations

import pytest
import torch

from ferrum.kernels.fp8_quant import FP8_MAX, per_token_group_quant_fp8, per_token_quant_fp8
from ferrum.kernels.fp8_quant_ref import (
    dequantize_per_token_group_ref,
    per_token_group_quant_fp8_ref,
    per_token_quant_fp8_ref,
)
from tests.utils.fp8_inputs import cuda_only, random_input, representable


def _assert_same_codes(q: torch.Tensor, expected: torch.Tensor) -> None:
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))


def test_reference_round_trip_and_scale() -> None:
    x = random_input(6, 512, torch.float32, torch.device("cpu"))
    q, scales = per_token_group_quant_fp8_ref(x)
    assert q.shape == (6, 512) and scales.shape == (6, 4)
    groups = x.view(6, 4, 128)
    torch.testing.assert_close(scales, groups.abs().amax(-1) / FP8_MAX, rtol=0, atol=0)
    # The abs-max of each group maps to +-FP8_MAX; 3 mantissa bits: relative error <= 1/16.
    assert torch.equal(q.float().view(6, 4, 128).abs().amax(-1), torch.full((6, 4), FP8_MAX))
    back = dequantize_per_token_group_ref(q, scales)
    bound = x.abs() / 16 + scales.repeat_interleave(128, 1) * 2.0**-9
    assert ((back - x).abs() <= bound).all()
    q_tok, s_tok = per_token_quant_fp8_ref(x)
    assert s_tok.shape == (6, 1)
    torch.testing.assert_close(s_tok[:, 0], x.abs().amax(1) / FP8_MAX, rtol=0, atol=0)


def test_reference_zero_group_has_zero_codes() -> None:
    x = torch.zeros(2, 256)
    x[1, 128:] = 1.0
    q, scales = per_token_group_quant_fp8_ref(x)
    assert (q.float()[:, :128] == 0).all() and (q.float()[0] == 0).all()
    assert (scales[:, 0] > 0).all() and scales[1, 1] == 1.0 / FP8_MAX


@pytest.mark.parametrize("rows,hidden", [(1, 128), (7, 384), (3, 2304)])
def test_group_quant_exact_on_representable(
    rows: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> None:
    x = representable(rows, hidden, 128, dtype, device)
    q, scales = per_token_group_quant_fp8(x)
    q_ref, scales_ref = per_token_group_quant_fp8_ref(x)
    _assert_same_codes(q, q_ref)
    torch.testing.assert_close(scales, scales_ref, rtol=0, atol=0)


@pytest.mark.parametrize("rows,hidden", [(1, 96), (5, 1000), (2, 3000)])
def test_token_quant_exact_on_representable(
    rows: int, hidden: int, dtype: torch.dtype, device: torch.device
) -> None:
    x = representable(rows, hidden, hidden, dtype, device, seed=1)
    q, scales = per_token_quant_fp8(x)
    q_ref, scales_ref = per_token_quant_fp8_ref(x)
    _assert_same_codes(q, q_ref)
    torch.testing.assert_close(scales, scales_ref, rtol=0, atol=0)


def test_strided_rows_and_group_size(device: torch.device) -> None:
    wide = representable(4, 512, 64, torch.float32, device, seed=2)
    x = wide[:, :256]  # row stride 512
    q, scales = per_token_group_quant_fp8(x, group_size=64)
    q_ref, scales_ref = per_token_group_quant_fp8_ref(x, group_size=64)
    assert q.is_contiguous() and scales.shape == (4, 4)
    _assert_same_codes(q, q_ref)
    torch.testing.assert_close(scales, scales_ref, rtol=0, atol=0)
    x_tok = representable(4, 512, 256, torch.float32, device, seed=3)[:, :256]
    q_tok, scales_tok = per_token_quant_fp8(x_tok)
    q_tok_ref, scales_tok_ref = per_token_quant_fp8_ref(x_tok)
    _assert_same_codes(q_tok, q_tok_ref)
    torch.testing.assert_close(scales_tok, scales_tok_ref, rtol=0, atol=0)


def test_no_rows(device: torch.device) -> None:
    q, scales = per_token_group_quant_fp8(torch.zeros(0, 256, device=device))
    assert q.shape == (0, 256) and scales.shape == (0, 2)
    q, scales = per_token_quant_fp8(torch.zeros(0, 100, device=device))
    assert q.shape == (0, 100) and scales.shape == (0, 1)


@cuda_only
@pytest.mark.parametrize("rows,hidden", [(1, 128), (33, 640), (257, 4096)])
def test_quant_bit_exact_on_random_cuda(rows: int, hidden: int, dtype: torch.dtype) -> None:
    x = random_input(rows, hidden, dtype, torch.device("cuda"))
    x[0, :128] = 0.0  # an all-zero group
    for kernel, ref in (
        (per_token_group_quant_fp8, per_token_group_quant_fp8_ref),
        (per_token_quant_fp8, per_token_quant_fp8_ref),
    ):
        q, scales = kernel(x)
        q_ref, scales_ref = ref(x)
        torch.testing.assert_close(scales, scales_ref, rtol=0, atol=0)
        _assert_same_codes(q, q_ref)


def test_validation_errors() -> None:
    x = torch.zeros(4, 256)
    with pytest.raises(ValueError, match="x must be"):
        per_token_group_quant_fp8(x.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="x must be"):
        per_token_quant_fp8(x.t())
    with pytest.raises(ValueError, match="multiple of group_size"):
        per_token_group_quant_fp8(torch.zeros(4, 200))
    with pytest.raises(ValueError, match="group_size"):
        per_token_group_quant_fp8(x, group_size=96)
    with pytest.raises(ValueError, match="hidden size"):
        per_token_quant_fp8(torch.zeros(4, 0))
