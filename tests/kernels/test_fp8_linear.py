from __future__ import annotations

import functools

import pytest
import torch

from ferrum.kernels.fp8_gemm_config import Fp8GemmConfig
from ferrum.kernels.fp8_gemm_ref import (
    fp8_weight_only_matmul_ref,
    w8a8_block_fp8_matmul_ref,
    w8a8_channel_fp8_matmul_ref,
)
from ferrum.kernels.fp8_linear import (
    _block_path,
    block_linear_takes_fp8_rows,
    block_scaled_mm_takes,
    fp8_block_linear,
    fp8_channel_linear,
    pad_group_rows,
    scaled_mm_takes,
)
from ferrum.kernels.fp8_quant import Fp8GroupRows, per_token_group_quant_fp8
from ferrum.kernels.fp8_weight import quantize_weight_block, quantize_weight_per_channel
from tests.utils.fp8_inputs import representable

SMALL = Fp8GemmConfig(quant="fused", BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_stages=2)
LARGE = Fp8GemmConfig(quant="separate", BLOCK_M=32, BLOCK_N=64, num_stages=2)
SCALED_MM = Fp8GemmConfig(backend="scaled_mm", BLOCK_M=32, BLOCK_N=64, num_stages=2)
GEMV = Fp8GemmConfig(backend="gemv", BLOCK_N=16, BLOCK_K=128)
WGMMA = Fp8GemmConfig(backend="wgmma", BLOCK_M=64, BLOCK_N=64, num_stages=3, UNROLL=4)


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    atol = tol * ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)


@pytest.mark.parametrize("m", [3, 20])
def test_block_linear_each_bucket(m: int, device: torch.device) -> None:
    """m=3 takes the fused bucket, m=20 quantizes first; leading dims are kept."""
    gen = torch.Generator().manual_seed(0)
    weight, scale_inv = (
        t.to(device) for t in quantize_weight_block(torch.randn(192, 256, generator=gen))
    )
    x = representable(2 * m, 256, 128, torch.float16, device).view(2, m, 256)
    out = fp8_block_linear(x, weight, scale_inv, buckets={8: SMALL, 64: LARGE})
    assert out.shape == (2, m, 192)
    ref = w8a8_block_fp8_matmul_ref(x.view(-1, 256), weight, scale_inv, torch.float16)
    _close(out.view(-1, 192), ref, 4e-3)


@pytest.mark.parametrize("m,backend", [(2, "fused"), (12, "separate"), (40, "scaled_mm")])
def test_channel_linear_each_bucket(m: int, backend: str, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    weight, scale = (
        t.to(device) for t in quantize_weight_per_channel(torch.randn(96, 160, generator=gen))
    )
    bias = torch.randn(96, generator=gen).to(device, torch.bfloat16)
    dtype = torch.bfloat16 if backend == "scaled_mm" else torch.float16
    x = representable(m, 160, 160, dtype, device, seed=m)
    out = fp8_channel_linear(
        x, weight, scale, bias.to(dtype), buckets={4: SMALL, 16: LARGE, 64: SCALED_MM}
    )
    ref = w8a8_channel_fp8_matmul_ref(x, weight, scale, dtype, bias=bias.to(dtype))
    _close(out, ref, 2e-2 if dtype == torch.bfloat16 else 4e-3)


def test_scaled_mm_bucket_falls_back_to_triton_where_cublas_cannot(device: torch.device) -> None:
    assert scaled_mm_takes(torch.bfloat16, 96, 160)
    assert not scaled_mm_takes(torch.float16, 96, 160)
    assert not scaled_mm_takes(torch.bfloat16, 100, 160)
    gen = torch.Generator().manual_seed(2)
    weight, scale = (
        t.to(device) for t in quantize_weight_per_channel(torch.randn(100, 160, generator=gen))
    )
    x = representable(5, 160, 160, torch.float16, device)
    out = fp8_channel_linear(x, weight, scale, buckets={64: SCALED_MM})
    _close(out, w8a8_channel_fp8_matmul_ref(x, weight, scale, torch.float16), 4e-3)


@pytest.mark.parametrize("given_rows", [False, True], ids=["quantizes", "rows"])
@pytest.mark.parametrize("m", [3, 70])
def test_wgmma_bucket(m: int, given_rows: bool, device: torch.device) -> None:
    """The Hopper wgmma GEMM where it runs (sm90, bf16/fp16 out), the bucket's Triton tile
    elsewhere (here on CPU, or on another GPU); the same result either way. K = 640: five K
    steps, so UNROLL 4 drops to 1; N = 320 ends in a partial weight-scale block; bias added."""
    gen = torch.Generator().manual_seed(m)
    weight, scale_inv = (
        t.to(device) for t in quantize_weight_block(torch.randn(320, 640, generator=gen))
    )
    bias = torch.randn(320, generator=gen).to(device, torch.float16)
    x = representable(m, 640, 128, torch.float16, device, seed=m)
    rows = Fp8GroupRows(*per_token_group_quant_fp8(x)) if given_rows else None
    out = fp8_block_linear(x, weight, scale_inv, bias, buckets={256: WGMMA}, x_fp8=rows)
    _close(out, w8a8_block_fp8_matmul_ref(x, weight, scale_inv, torch.float16, bias=bias), 4e-3)
    assert block_linear_takes_fp8_rows(device, x.dtype, 320, 640, m, {256: WGMMA}) == (
        device.type == "cuda"
    )
    on_hopper = device.type == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert (_block_path(WGMMA, device, x.dtype, 320, 640) == "wgmma") == on_hopper


def test_wgmma_bucket_refused_for_per_channel_weights() -> None:
    weight, scale = quantize_weight_per_channel(torch.randn(32, 128))
    with pytest.raises(ValueError, match="'wgmma' serves block-scaled weights only"):
        fp8_channel_linear(torch.randn(2, 128).half(), weight, scale, buckets={8: WGMMA})


def test_default_buckets_run(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(128, 128, generator=gen)
    weight, scale_inv = (t.to(device) for t in quantize_weight_block(w))
    x = representable(2, 128, 128, torch.float16, device)
    _close(
        fp8_block_linear(x, weight, scale_inv),
        w8a8_block_fp8_matmul_ref(x, weight, scale_inv, torch.float16),
        4e-3,
    )


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="cuBLASLt block-scaled FP8 GEMMs need a Hopper GPU",
)
@pytest.mark.parametrize("m", [1, 3, 64, 300])
def test_block_linear_cublas_matches_reference(m: int) -> None:
    """Default buckets take cuBLASLt's block-scaled GEMM for bf16 from two rows on (one row takes
    the GEMV); M is padded to 4 inside and K = 384 has 3 scale columns (padded to 4)."""
    gen = torch.Generator().manual_seed(m)
    weight, scale_inv = (
        t.cuda() for t in quantize_weight_block(torch.randn(256, 384, generator=gen) * 0.05)
    )
    bias = torch.randn(256, generator=gen).cuda().bfloat16()
    x = torch.randn(m, 384, generator=gen).cuda().bfloat16()
    assert block_scaled_mm_takes(x.device, x.dtype, 256, 384)
    assert not block_scaled_mm_takes(x.device, torch.float16, 256, 384)
    assert not block_scaled_mm_takes(x.device, x.dtype, 192, 384)
    out = fp8_block_linear(x, weight, scale_inv, bias)
    if m == 1:  # one row takes the weight-only GEMV
        ref = fp8_weight_only_matmul_ref(x, weight, scale_inv, True, torch.bfloat16, bias=bias)
    else:
        ref = w8a8_block_fp8_matmul_ref(x, weight, scale_inv, torch.bfloat16, bias=bias)
    _close(out, ref, 2e-2)


def test_validation_errors() -> None:
    weight, scale = quantize_weight_per_channel(torch.randn(32, 64))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        fp8_channel_linear(torch.zeros(2, 32, dtype=torch.float16), weight, scale)
    with pytest.raises(ValueError, match="x must be"):
        fp8_channel_linear(torch.zeros(2, 64), weight, scale)
    with pytest.raises(ValueError, match="weight_scale must be"):
        fp8_channel_linear(
            torch.zeros(2, 64, dtype=torch.bfloat16), weight, scale.double(), buckets={8: SCALED_MM}
        )


def test_block_linear_reads_given_rows(device: torch.device) -> None:
    """Every bucket but the GEMV reads x_fp8 in place of quantizing x: rows of another input
    give that input's product, in a separate-quantization bucket and in a fused one (whose tile
    then reads the codes it would have made); the GEMV multiplies x itself."""
    gen = torch.Generator().manual_seed(4)
    weight, scale_inv = (
        t.to(device) for t in quantize_weight_block(torch.randn(192, 256, generator=gen))
    )
    x = representable(20, 256, 128, torch.float16, device, seed=5)
    other = representable(20, 256, 128, torch.float16, device, seed=6)
    rows = Fp8GroupRows(*per_token_group_quant_fp8(other))
    buckets = {8: SMALL, 64: LARGE}
    got = fp8_block_linear(x, weight, scale_inv, buckets=buckets, x_fp8=rows)
    assert torch.equal(got, fp8_block_linear(other, weight, scale_inv, buckets=buckets))
    assert not torch.equal(got, fp8_block_linear(x, weight, scale_inv, buckets=buckets))
    few, few_other = x[:3], other[:3]
    few_rows = Fp8GroupRows(*per_token_group_quant_fp8(few_other))
    got = fp8_block_linear(few, weight, scale_inv, buckets=buckets, x_fp8=few_rows)
    assert torch.equal(got, fp8_block_linear(few_other, weight, scale_inv, buckets=buckets))
    gemv = {1: GEMV}
    one_rows = Fp8GroupRows(*per_token_group_quant_fp8(other[:1]))
    assert torch.equal(
        fp8_block_linear(x[:1], weight, scale_inv, buckets=gemv, x_fp8=one_rows),
        fp8_block_linear(x[:1], weight, scale_inv, buckets=gemv),
    )
    with pytest.raises(ValueError, match="x_fp8 must hold"):
        fp8_block_linear(x[:4], weight, scale_inv, buckets=buckets, x_fp8=rows)
    bad_scales = Fp8GroupRows(rows.q, rows.scales[:, :1].contiguous())
    with pytest.raises(ValueError, match="x_fp8 must hold"):
        fp8_block_linear(x, weight, scale_inv, buckets=buckets, x_fp8=bad_scales)


def test_which_buckets_take_fp8_rows() -> None:
    cuda = torch.device("cuda")  # a name only: nothing runs on it
    buckets = {1: GEMV, 8: SMALL, 64: LARGE, 256: SCALED_MM}
    takes = functools.partial(block_linear_takes_fp8_rows, n=192, k=256, buckets=buckets)
    assert [takes(cuda, torch.float16, num_rows=m) for m in (1, 3, 20, 200)] == [
        False,  # the GEMV quantizes nothing
        True,  # the fused GEMM's tiles read the codes they would have made
        True,
        True,  # fp16: cuBLASLt cannot, the bucket's Triton tile runs
    ]
    # cuBLASLt (bf16 on an H100, faked here) reads rows at any count, padded to 4.
    assert all(
        takes(cuda, torch.bfloat16, num_rows=m, buckets={256: SCALED_MM}) for m in (3, 5, 64)
    )
    assert not takes(torch.device("cpu"), torch.float16, num_rows=20)
    assert not takes(cuda, torch.float32, num_rows=20)
    assert not takes(cuda, torch.float16, num_rows=0)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="cuBLASLt block-scaled FP8 GEMMs need a Hopper GPU",
)
@pytest.mark.parametrize("m", [3, 64])
def test_block_linear_cublas_reads_given_rows_padded_to_four(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    weight, scale_inv = (
        t.cuda() for t in quantize_weight_block(torch.randn(256, 384, generator=gen) * 0.05)
    )
    x, other = (torch.randn(m, 384, generator=gen).cuda().bfloat16() for _ in range(2))
    rows = Fp8GroupRows(*per_token_group_quant_fp8(other))
    buckets = {256: SCALED_MM}
    assert block_linear_takes_fp8_rows(x.device, x.dtype, 256, 384, m, buckets)
    got = fp8_block_linear(x, weight, scale_inv, buckets=buckets, x_fp8=rows)
    assert torch.equal(got, fp8_block_linear(other, weight, scale_inv, buckets=buckets))


def test_pad_group_rows_appends_zero_rows(device: torch.device) -> None:
    rows = Fp8GroupRows(*per_token_group_quant_fp8(torch.randn(3, 256, device=device)))
    q, scales = pad_group_rows(rows, 1)
    assert q.dtype == rows.q.dtype and q.shape == (4, 256) and scales.shape == (4, 2)
    assert torch.equal(q[:3].view(torch.uint8), rows.q.view(torch.uint8))
    assert torch.equal(scales[:3], rows.scales)
    assert not q[3].view(torch.uint8).any() and not scales[3].any()
    q0, scales0 = pad_group_rows(rows, 0)
    assert q0 is rows.q and scales0 is rows.scales
