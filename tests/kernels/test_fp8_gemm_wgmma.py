from __future__ import annotations

import importlib
import sys

import pytest
import torch

from ferrum.kernels import fp8_gemm_wgmma
from ferrum.kernels.fp8_gemm_ref import w8a8_block_fp8_matmul_ref
from ferrum.kernels.fp8_gemm_wgmma import w8a8_block_fp8_matmul_wgmma, wgmma_gemm_takes
from ferrum.kernels.fp8_quant_ref import per_token_group_quant_fp8_ref
from ferrum.kernels.fp8_weight import quantize_weight_block
from tests.utils.fp8_inputs import random_input

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
hopper_only = pytest.mark.skipif(not ON_HOPPER, reason="wgmma is a Hopper (sm90) instruction")
# (BLOCK_M, BLOCK_N, num_warps, num_stages, UNROLL): one and two warpgroups (along M, and along N
# for 64 rows), the narrowest to the widest tile, buffers fewer and more than the K steps.
TILES = [
    (64, 64, 4, 2, 1), (64, 128, 4, 4, 2), (64, 32, 4, 8, 4), (128, 64, 8, 6, 4),
    (64, 16, 4, 3, 2), (64, 64, 8, 4, 2),
]  # fmt: skip


def _assert_rows_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Each row within tol of its own abs-max: the inputs' rows span four decades, so a bound on
    the whole output's abs-max would not see a wrong tile of small rows."""
    bound = tol * ref.abs().amax(1, keepdim=True) + 1e-6
    assert ((out.float() - ref).abs() <= bound).all()


def _operands(m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]
    weight, scale_inv = (t.cuda() for t in quantize_weight_block(w))
    a, a_scale = per_token_group_quant_fp8_ref(random_input(m, k, torch.float32, "cuda", seed))
    return a, a_scale, weight, scale_inv


@hopper_only
@pytest.mark.parametrize("tile", TILES, ids=lambda t: "m{}n{}w{}s{}u{}".format(*t))
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (63, 320, 640), (130, 200, 1024), (257, 96, 384)])
def test_matches_reference(m: int, n: int, k: int, tile: tuple[int, ...]) -> None:
    """Rows and columns past the tiles (M 1..257, N not a multiple of 128), K of 1 to 8 steps
    (UNROLL dropping to what divides them)."""
    a, a_scale, weight, scale_inv = _operands(m, n, k)
    out = w8a8_block_fp8_matmul_wgmma(a, a_scale, weight, scale_inv, torch.bfloat16, *tile)
    ref = w8a8_block_fp8_matmul_ref(a, weight, scale_inv, torch.float32, a_scale=a_scale)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    _assert_rows_close(out, ref, 2e-2)


@hopper_only
def test_bias_and_fp16_output() -> None:
    a, a_scale, weight, scale_inv = _operands(70, 256, 512, seed=3)
    bias = torch.randn(256, device="cuda", dtype=torch.float16)
    out = w8a8_block_fp8_matmul_wgmma(
        a, a_scale, weight, scale_inv, torch.float16, 64, 128, 4, 3, 2, bias=bias
    )
    ref = w8a8_block_fp8_matmul_ref(a, weight, scale_inv, torch.float32, a_scale=a_scale, bias=bias)
    assert out.dtype == torch.float16
    _assert_rows_close(out, ref, 4e-3)


@hopper_only
def test_zero_rows() -> None:
    a, a_scale, weight, scale_inv = _operands(0, 128, 256)
    assert w8a8_block_fp8_matmul_wgmma(a, a_scale, weight, scale_inv, torch.bfloat16).shape == (
        0,
        128,
    )


def test_the_pinned_triton_has_gluon_hopper() -> None:
    """The test dependency (Triton 3.6) has the API, so the kernel module imports in CI: an error
    in it fails here rather than switching the kernel off."""
    assert fp8_gemm_wgmma.TRITON_HAS_GLUON_HOPPER
    assert (torch.bfloat16, torch.float16) == fp8_gemm_wgmma.OUT_DTYPES


def test_a_triton_without_gluon_takes_nothing() -> None:
    hopper = "triton.experimental.gluon.language.nvidia.hopper"
    saved = sys.modules.get(hopper)
    sys.modules[hopper] = None  # importing it now raises ImportError
    try:
        module = importlib.reload(fp8_gemm_wgmma)
        assert not module.TRITON_HAS_GLUON_HOPPER and module.OUT_DTYPES == ()
        assert not module.wgmma_gemm_takes(torch.device("cuda", 0), torch.bfloat16, 128, 256)
    finally:
        if saved is None:
            del sys.modules[hopper]
        else:
            sys.modules[hopper] = saved
        importlib.reload(fp8_gemm_wgmma)
    assert fp8_gemm_wgmma.TRITON_HAS_GLUON_HOPPER


def test_refuses_what_it_cannot_run() -> None:
    """Off Hopper (here: the CPU) and for an fp32 output, N % 8 or K % 128, it says so."""
    gen = torch.Generator().manual_seed(0)
    weight, scale_inv = quantize_weight_block(torch.randn(128, 256, generator=gen))
    a, a_scale = per_token_group_quant_fp8_ref(torch.randn(4, 256, generator=gen))
    cpu = torch.device("cpu")
    assert not wgmma_gemm_takes(cpu, torch.bfloat16, 128, 256)
    with pytest.raises(ValueError, match="the wgmma GEMM needs a Hopper GPU"):
        w8a8_block_fp8_matmul_wgmma(a, a_scale, weight, scale_inv, torch.bfloat16)
    with pytest.raises(ValueError, match="BLOCK_M 64 or 128"):
        w8a8_block_fp8_matmul_wgmma(a, a_scale, weight, scale_inv, torch.bfloat16, block_m=32)
    if ON_HOPPER:
        gpu = torch.device("cuda")
        assert wgmma_gemm_takes(gpu, torch.float16, 128, 256)
        assert not wgmma_gemm_takes(gpu, torch.float32, 128, 256)
        assert not wgmma_gemm_takes(gpu, torch.bfloat16, 100, 256)
        assert not wgmma_gemm_takes(gpu, torch.bfloat16, 128, 200)
