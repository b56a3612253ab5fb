"""The FP8 GEMV (one activation row a program, weight-only: the activations are not quantized)
against the dequantized-weight reference, block and per-channel scales, with N and K that leave
partial tiles; on CUDA at a decode shape with random inputs as well."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.fp8_gemm_config import Fp8GemmConfig
from ferrum.kernels.fp8_gemm_ref import fp8_weight_only_matmul_ref
from ferrum.kernels.fp8_gemv import fp8_gemv
from ferrum.kernels.fp8_linear import fp8_block_linear, fp8_channel_linear
from ferrum.kernels.fp8_weight import quantize_weight_block, quantize_weight_per_channel
from tests.utils.fp8_inputs import cuda_only, random_input


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    atol = tol * ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=atol)


def _weights(n: int, k: int, block: bool, device: torch.device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]
    quantize = quantize_weight_block if block else quantize_weight_per_channel
    return tuple(t.to(device) for t in quantize(w))


# N = 200 leaves a partial BLOCK_N tile and a partial 128-row scale block; K = 640 with BLOCK_K
# 256 or 512 leaves a partial K step of whole scale groups.
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("block_n,block_k", [(16, 256), (8, 128), (32, 512)])
def test_block_gemv_matches_reference(m, block_n, block_k, device) -> None:
    n, k = 200, 640
    weight, scale = _weights(n, k, True, device, seed=m)
    x = random_input(m, k, torch.float16, device, seed=m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(9)).to(device, torch.float16)
    out = fp8_gemv(x, weight, scale, torch.float16, True, block_n, block_k, bias=bias)
    ref = fp8_weight_only_matmul_ref(x, weight, scale, True, torch.float16, bias=bias)
    _close(out, ref, 2e-3)


# K = 200: BLOCK_K 256 covers it in one partial step, 64 in four (the last partial).
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("block_n,block_k", [(16, 256), (4, 64)])
def test_channel_gemv_matches_reference(m, block_n, block_k, device) -> None:
    n, k = 72, 200
    weight, scale = _weights(n, k, False, device, seed=m)
    x = random_input(m, k, torch.float32, device, seed=m)
    out = fp8_gemv(x, weight, scale, torch.float32, False, block_n, block_k)
    ref = fp8_weight_only_matmul_ref(x, weight, scale, False, torch.float32)
    _close(out, ref, 1e-5)


def test_linear_layers_take_the_gemv_bucket(device) -> None:
    gemv = Fp8GemmConfig(backend="gemv", BLOCK_N=16, BLOCK_K=256)
    other = Fp8GemmConfig(quant="separate", BLOCK_M=16, BLOCK_N=32, num_stages=2)
    weight, scale = _weights(256, 384, True, device)
    x = random_input(2, 384, torch.float16, device, seed=4).view(1, 2, 384)
    out = fp8_block_linear(x, weight, scale, buckets={2: gemv, 64: other})
    ref = fp8_weight_only_matmul_ref(x.view(2, 384), weight, scale, True, torch.float16)
    _close(out.view(2, 256), ref, 2e-3)
    weight, scale = _weights(96, 160, False, device)
    x = random_input(1, 160, torch.float16, device, seed=5)
    out = fp8_channel_linear(x, weight, scale, buckets={1: gemv, 64: other})
    _close(out, fp8_weight_only_matmul_ref(x, weight, scale, False, torch.float16), 2e-3)


@cuda_only
@pytest.mark.parametrize("block", [True, False])
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_random_inputs_on_cuda(block: bool, m: int) -> None:
    device = torch.device("cuda")
    n, k = 4096 + 64, 2048 + 128
    weight, scale = _weights(n, k, block, device)
    x = random_input(m, k, torch.bfloat16, device, seed=m)
    out = fp8_gemv(x, weight, scale, torch.bfloat16, block, 16, 512)
    _close(out, fp8_weight_only_matmul_ref(x, weight, scale, block, torch.bfloat16), 5e-3)


def test_gemv_checks_its_arguments(device) -> None:
    weight, scale = _weights(128, 256, True, device)
    x = torch.zeros(1, 256, device=device)
    with pytest.raises(ValueError, match="BLOCK_N dividing 128"):
        fp8_gemv(x, weight, scale, torch.float32, True, 256, 256)
    with pytest.raises(ValueError, match="BLOCK_K a multiple of 128"):
        fp8_gemv(x, weight, scale, torch.float32, True, 16, 64)
    with pytest.raises(ValueError, match=r"weight_scale must be \[128, 1\]"):
        fp8_gemv(x, weight, scale, torch.float32, False, 16, 64)
    with pytest.raises(ValueError, match="x must be"):
        fp8_gemv(x.t(), weight, scale, torch.float32, True, 16, 128)
    strided = torch.zeros(128, 2, device=device)[:, 0]
    with pytest.raises(ValueError, match="bias must be contiguous"):
        fp8_gemv(x, weight, scale, torch.float32, True, 16, 128, bias=strided)
    with pytest.raises(ValueError, match="power of two"):
        Fp8GemmConfig(backend="gemv", BLOCK_N=12)
    with pytest.raises(ValueError, match=">= 16"):
        Fp8GemmConfig(backend="triton", BLOCK_N=8)
