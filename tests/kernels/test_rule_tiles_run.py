"""The kernels compute the right results with the tiles the default rules choose (on CUDA, or
under the Triton interpreter on the CPU), at small odd shapes on fake devices whose rules pick
split-K, narrow GEMV rows, the wgmma shape's Triton fallback, and each MoE path."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.device_properties import A100, H100, L40S
from ferrum.kernels.fp8_gemm import w8a8_block_fp8_matmul, w8a8_channel_fp8_matmul
from ferrum.kernels.fp8_gemm_ref import (
    fp8_weight_only_matmul_ref,
    w8a8_block_fp8_matmul_ref,
    w8a8_channel_fp8_matmul_ref,
)
from ferrum.kernels.fp8_gemm_rule import bucket_rule
from ferrum.kernels.fp8_gemv import fp8_gemv
from ferrum.kernels.fp8_quant_ref import per_token_group_quant_fp8_ref, per_token_quant_fp8_ref
from ferrum.kernels.fp8_weight import quantize_weight_block, quantize_weight_per_channel
from ferrum.kernels.fused_moe import fused_moe
from ferrum.kernels.fused_moe_ref import fused_moe_fp8_ref, fused_moe_ref, select_experts
from ferrum.kernels.fused_moe_rule import grouped_rule, small_rule
from ferrum.kernels.gemv import gemv
from ferrum.kernels.tile_rules import gemv_tile_rule
from tests.utils.fp8_inputs import random_input


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float = 2e-3) -> None:
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=tol * scale)


@pytest.mark.parametrize(
    ("device_props", "m", "n", "k"),
    [(A100, 5, 128, 2048), (L40S, 16, 200, 1024), (H100, 40, 192, 384), (L40S, 300, 256, 256)],
    ids=["a100-split-k", "l40s-16", "h100-wgmma-fallback", "l40s-large"],
)
def test_fp8_block_gemm_with_the_rule_tile(device_props, m, n, k, device) -> None:
    config = bucket_rule("block", n, k, m, device_props)
    if device_props is A100 and m == 5:
        assert config.SPLIT_K > 1  # the case this row is here for
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(n, k, generator=gen)
    weight, scale_inv = (t.to(device) for t in quantize_weight_block(w))
    a, a_scale = per_token_group_quant_fp8_ref(random_input(m, k, torch.float32, device))
    out = w8a8_block_fp8_matmul(a, weight, scale_inv, torch.float32, config, a_scale=a_scale)
    _close(out, w8a8_block_fp8_matmul_ref(a, weight, scale_inv, torch.float32, a_scale=a_scale))


def test_fp8_channel_gemm_with_the_rule_tile(device) -> None:
    m, n, k = 64, 160, 1024
    config = bucket_rule("channel", n, k, m, A100)
    assert config.backend == "triton" and config.BLOCK_N == 32  # narrowed to make a wave
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen)
    weight, scale = (t.to(device) for t in quantize_weight_per_channel(w))
    a, a_scale = per_token_quant_fp8_ref(random_input(m, k, torch.float32, device))
    out = w8a8_channel_fp8_matmul(a, weight, scale, torch.float32, config, a_scale=a_scale)
    _close(out, w8a8_channel_fp8_matmul_ref(a, weight, scale, torch.float32, a_scale=a_scale))


@pytest.mark.parametrize(("n", "k"), [(96, 640), (300, 384)])
def test_gemvs_with_the_rule_tile(n, k, device) -> None:
    block_n, block_k, num_warps, num_stages = gemv_tile_rule(n, k, H100)
    assert block_n < 4  # few rows: narrower programs
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(1, k, generator=gen)
    half = (x.half().to(device), w.half().to(device))
    out = gemv(*half, block_n, block_k, num_warps, num_stages)
    _close(out.cpu(), x.half().float() @ w.half().float().T, 2e-3)
    q, scale_inv = quantize_weight_block(w)
    out = fp8_gemv(x.to(device), q.to(device), scale_inv.to(device), torch.float32, True,
                   block_n, block_k, num_warps, num_stages)  # fmt: skip
    expected = fp8_weight_only_matmul_ref(x, q, scale_inv, True, torch.float32)
    _close(out.cpu(), expected, 1e-5)


@pytest.mark.parametrize("num_tokens", [2, 6, 40])
def test_fused_moe_with_the_rule_tiles(num_tokens, device) -> None:
    num_experts, inter, hidden, top_k = 8, 128, 256, 2
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.2).to(device)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * 0.2).to(device)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    weights, ids = weights.to(device), ids.to(device)
    shape = (num_experts, inter, hidden, top_k, L40S)
    grouped, small = grouped_rule(num_tokens, *shape), small_rule(num_tokens, *shape)
    out = fused_moe(x, w13, w2, weights, ids, config=grouped, small_config=small,
                    small_batch_max_tokens=8)  # fmt: skip
    _close(out, fused_moe_ref(x, w13, w2, weights, ids), 1e-4)


@pytest.mark.parametrize("num_tokens", [1, 20])
def test_fp8_fused_moe_with_the_rule_tiles(num_tokens, device) -> None:
    num_experts, inter, hidden, top_k = 4, 256, 256, 2
    gen = torch.Generator().manual_seed(num_tokens)
    experts = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        w = torch.randn(num_experts, rows, cols, generator=gen) * 0.2
        pairs = [quantize_weight_block(w[e]) for e in range(num_experts)]
        experts += [torch.stack([p[i] for p in pairs]).to(device) for i in (0, 1)]
    w13, s13, w2, s2 = experts
    x = torch.randn(num_tokens, hidden, generator=gen).to(device)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    weights, ids = weights.to(device), ids.to(device)
    shape = (num_experts, inter, hidden, top_k, H100, True)
    small = small_rule(num_tokens, *shape)
    if num_tokens == 1:
        assert small["DOWN_SPLIT"] == 1  # FP8 experts: a program per choice at one token
    grouped = grouped_rule(num_tokens, *shape)
    scales = {"w13_scale": s13, "w2_scale": s2}
    out = fused_moe(
        x, w13, w2, weights, ids, config=grouped, small_config=small, small_batch_max_tokens=8,
        **scales,
    )  # fmt: skip
    _close(out, fused_moe_fp8_ref(x, w13, w2, weights, ids, s13, s2), 1e-4)
