from __future__ import annotations

import dataclasses

import pytest
import torch

from ferrum.kernels.arrival_counters import arrival_counters
from ferrum.kernels.fp8_gemm import (
    w8a8_block_fp8_matmul,
    w8a8_channel_fp8_matmul,
)
from ferrum.kernels.fp8_gemm_config import Fp8GemmConfig
from ferrum.kernels.fp8_gemm_ref import w8a8_block_fp8_matmul_ref, w8a8_channel_fp8_matmul_ref
from ferrum.kernels.fp8_quant_ref import per_token_group_quant_fp8_ref, per_token_quant_fp8_ref
from ferrum.kernels.fp8_weight import quantize_weight_block, quantize_weight_per_channel
from tests.utils.fp8_inputs import cuda_only, random_input, representable

ON_CUDA = torch.cuda.is_available()
OUT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
# Relative to the output's abs-max: fp32 sums in another order (and Hopper's fp8 MMA keeps ~14
# mantissa bits per K step), then one rounding to the output dtype.
TOL = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}
CONFIGS = [
    Fp8GemmConfig(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_stages=2),
    Fp8GemmConfig(BLOCK_M=32, BLOCK_N=128, GROUP_M=4, num_stages=2),
    # Three splits: uneven shares of 2-3 K steps, and an empty split where K has only 2 steps.
    Fp8GemmConfig(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_stages=2, SPLIT_K=3),
]


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=TOL[ref.dtype] * scale)


def _block_weight(n: int, k: int, device: torch.device, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]
    q, scale_inv = quantize_weight_block(w)
    return q.to(device), scale_inv.to(device)


def _channel_weight(n: int, k: int, device: torch.device, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    q, scale = quantize_weight_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    return q.to(device), scale.to(device)


@pytest.mark.parametrize("config", CONFIGS, ids=["m16n64", "m32n128", "m16n64s3"])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("m,n,k", [(1, 192, 256), (37, 200, 384), (70, 128, 128)])
def test_block_gemm_prequantized(
    m: int, n: int, k: int, out_dtype: torch.dtype, config: Fp8GemmConfig, device: torch.device
) -> None:
    weight, scale_inv = _block_weight(n, k, device)
    a, a_scale = per_token_group_quant_fp8_ref(random_input(m, k, torch.float32, device))
    out = w8a8_block_fp8_matmul(a, weight, scale_inv, out_dtype, config, a_scale=a_scale)
    ref = w8a8_block_fp8_matmul_ref(a, weight, scale_inv, out_dtype, a_scale=a_scale)
    _assert_close(out, ref)


@pytest.mark.parametrize(
    "config",
    [
        Fp8GemmConfig(BLOCK_M=16, BLOCK_N=32, GROUP_M=1, num_stages=2),
        Fp8GemmConfig(BLOCK_M=16, BLOCK_N=256, GROUP_M=2, num_stages=2),
        Fp8GemmConfig(BLOCK_M=16, BLOCK_N=256, GROUP_M=1, num_stages=2, SPLIT_K=2),
    ],
    ids=["n32", "n256", "n256s2"],
)
@pytest.mark.parametrize("a_fp8", [True, False], ids=["prequantized", "fused"])
def test_block_gemm_tiles_within_and_across_weight_blocks(
    config: Fp8GemmConfig, a_fp8: bool, device: torch.device
) -> None:
    """A tile of 32 columns reads one weight scale a K step (its columns share a 128-row weight
    block); a tile of 256 spans two blocks and scales each column by its own; N ends inside a
    block."""
    m, n, k = 21, 320, 512
    weight, scale_inv = _block_weight(n, k, device, seed=3)
    x = representable(m, k, 128, torch.float32, device)
    a, a_scale = per_token_group_quant_fp8_ref(x) if a_fp8 else (x, None)
    out = w8a8_block_fp8_matmul(a, weight, scale_inv, torch.float32, config, a_scale=a_scale)
    ref = w8a8_block_fp8_matmul_ref(a, weight, scale_inv, torch.float32, a_scale=a_scale)
    _assert_close(out, ref)


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]], ids=["m16n64", "m16n64s3"])
@pytest.mark.parametrize("m,n,k", [(1, 192, 256), (19, 320, 384)])
def test_block_gemm_fused_quant(
    m: int, n: int, k: int, config: Fp8GemmConfig, dtype: torch.dtype, device: torch.device
) -> None:
    """Bias added once, also where split-K programs share a tile."""
    weight, scale_inv = _block_weight(n, k, device, seed=2)
    x = representable(m, k, 128, dtype, device)
    bias = torch.randn(n).to(device, dtype)
    out = w8a8_block_fp8_matmul(x, weight, scale_inv, dtype, config, bias=bias)
    _assert_close(out, w8a8_block_fp8_matmul_ref(x, weight, scale_inv, dtype, bias=bias))


@pytest.mark.parametrize("config", CONFIGS + [Fp8GemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)])
@pytest.mark.parametrize("m,n,k", [(3, 96, 256), (41, 200, 200)])
def test_channel_gemm_prequantized_and_fused(
    m: int, n: int, k: int, config: Fp8GemmConfig, device: torch.device
) -> None:
    weight, scale = _channel_weight(n, k, device)
    x = representable(m, k, k, torch.float16, device, seed=3)
    a, a_scale = per_token_quant_fp8_ref(x)
    ref = w8a8_channel_fp8_matmul_ref(a, weight, scale, torch.float16, a_scale=a_scale)
    out = w8a8_channel_fp8_matmul(a, weight, scale, torch.float16, config, a_scale=a_scale)
    _assert_close(out, ref)
    _assert_close(w8a8_channel_fp8_matmul(x, weight, scale, torch.float16, config), ref)


@pytest.mark.parametrize("block_scales", [True, False], ids=["block", "channel"])
def test_split_k_sums_partials_in_order_and_resets_its_counters(
    block_scales: bool, device: torch.device
) -> None:
    """Four splits of 2 K steps each: the output is the partials added in split order, whatever
    the order the programs finished in, and the counters are back at zero for the next launch."""
    m, n, k = 5, 256, 1024
    make = _block_weight if block_scales else _channel_weight
    gemm = w8a8_block_fp8_matmul if block_scales else w8a8_channel_fp8_matmul
    weight, scale = make(n, k, device, seed=4)
    x = representable(m, k, 128 if block_scales else k, torch.float32, device, seed=5)
    split = Fp8GemmConfig(BLOCK_M=16, BLOCK_N=64, GROUP_M=1, num_stages=2, SPLIT_K=4)
    outs = [gemm(x, weight, scale, torch.float32, split) for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    num_tiles = n // 64
    assert not arrival_counters(device, num_tiles, "test")[:num_tiles].any()
    if not block_scales:  # per-token scales come from the whole row: no per-quarter launches
        _assert_close(outs[0], w8a8_channel_fp8_matmul_ref(x, weight, scale, torch.float32))
        return
    # The same sum by hand: one launch per quarter of K (2 scale groups each), added in order.
    one = dataclasses.replace(split, SPLIT_K=1)
    quarters = [
        gemm(
            x[:, q * 256 : (q + 1) * 256].contiguous(),
            weight[:, q * 256 : (q + 1) * 256].contiguous(),
            scale[:, q * 2 : (q + 1) * 2].contiguous(),
            torch.float32,
            one,
        )
        for q in range(4)
    ]
    expected = ((quarters[0] + quarters[1]) + quarters[2]) + quarters[3]
    assert torch.equal(outs[0], expected)
    assert not torch.equal(outs[0], ((quarters[3] + quarters[2]) + quarters[1]) + quarters[0])


def test_strided_activation_rows(device: torch.device) -> None:
    weight, scale_inv = _block_weight(128, 256, device)
    x = representable(9, 512, 128, torch.float32, device)[:, :256]
    out = w8a8_block_fp8_matmul(x, weight, scale_inv, torch.float32, CONFIGS[0])
    _assert_close(out, w8a8_block_fp8_matmul_ref(x, weight, scale_inv, torch.float32))


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]], ids=["m16n64", "m16n64s3"])
def test_no_rows(config: Fp8GemmConfig, device: torch.device) -> None:
    weight, scale_inv = _block_weight(128, 128, device)
    out = w8a8_block_fp8_matmul(
        torch.zeros(0, 128, device=device), weight, scale_inv, torch.float16, config
    )
    assert out.shape == (0, 128) and out.dtype == torch.float16


@cuda_only
@pytest.mark.parametrize("config", CONFIGS + [Fp8GemmConfig(BLOCK_M=128, num_warps=8)])
@pytest.mark.parametrize("m,n,k", [(1, 4224, 1152), (61, 1000, 2048), (300, 384, 640)])
def test_fused_quant_random_inputs_cuda(
    m: int, n: int, k: int, dtype: torch.dtype, config: Fp8GemmConfig
) -> None:
    device = torch.device("cuda")
    x = random_input(m, k, dtype, device)
    weight, scale_inv = _block_weight(n, k, device)
    out = w8a8_block_fp8_matmul(x, weight, scale_inv, dtype, config)
    _assert_close(out, w8a8_block_fp8_matmul_ref(x, weight, scale_inv, dtype))
    weight, scale = _channel_weight(n, k, device)
    out = w8a8_channel_fp8_matmul(x, weight, scale, dtype, config)
    _assert_close(out, w8a8_channel_fp8_matmul_ref(x, weight, scale, dtype))


def test_validation_errors() -> None:
    cpu = torch.device("cpu")
    weight, scale_inv = _block_weight(256, 256, cpu)
    x = torch.zeros(4, 256)
    cfg = CONFIGS[0]
    with pytest.raises(ValueError, match="a must be"):
        w8a8_block_fp8_matmul(x.t(), weight, scale_inv, torch.float32, cfg)
    with pytest.raises(ValueError, match="a_scale must be given"):
        w8a8_block_fp8_matmul(x.to(torch.float8_e4m3fn), weight, scale_inv, torch.float32, cfg)
    with pytest.raises(ValueError, match="weight must be"):
        w8a8_block_fp8_matmul(x, weight.float(), scale_inv, torch.float32, cfg)
    with pytest.raises(ValueError, match=r"weight must be \[N, 256\]"):
        w8a8_block_fp8_matmul(x, weight[:, :128], scale_inv, torch.float32, cfg)
    with pytest.raises(ValueError, match="weight_scale_inv must be"):
        w8a8_block_fp8_matmul(x, weight, scale_inv[:1], torch.float32, cfg)
    with pytest.raises(ValueError, match="K must be a multiple of 128"):
        w8a8_block_fp8_matmul(x[:, :200], weight[:, :200], scale_inv, torch.float32, cfg)
    with pytest.raises(ValueError, match="BLOCK_K must be 128"):
        w8a8_block_fp8_matmul(x, weight, scale_inv, torch.float32, Fp8GemmConfig(BLOCK_K=64))
    with pytest.raises(ValueError, match="out_dtype"):
        w8a8_block_fp8_matmul(x, weight, scale_inv, torch.int32, cfg)
    with pytest.raises(ValueError, match="bias must be"):
        w8a8_block_fp8_matmul(x, weight, scale_inv, torch.float32, cfg, bias=torch.zeros(3))
    a, a_scale = per_token_group_quant_fp8_ref(x)
    with pytest.raises(ValueError, match="a_scale must be"):
        w8a8_block_fp8_matmul(a, weight, scale_inv, torch.float32, cfg, a_scale=a_scale[:2])
    weight_c, scale_c = _channel_weight(256, 256, cpu)
    with pytest.raises(ValueError, match="weight_scale must be"):
        w8a8_channel_fp8_matmul(x, weight_c, scale_c.view(-1), torch.float32, cfg)
    with pytest.raises(ValueError, match="a_scale must be"):
        w8a8_channel_fp8_matmul(a, weight_c, scale_c, torch.float32, cfg, a_scale=a_scale)
