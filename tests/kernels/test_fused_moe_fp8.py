"""Triton fused MoE with FP8 experts (128x128 block scales applied in the kernel) against
`fused_moe_fp8_ref`, on both paths. The weights are FP8 codes already, so no fp32 -> fp8 cast runs
in the kernel and the Triton CPU interpreter computes it exactly like the GPU."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.fused_moe import fused_moe
from ferrum.kernels.fused_moe_ref import (
    dequantize_experts,
    fused_moe_fp8_ref,
    fused_moe_ref,
    select_experts,
)

FP8 = torch.float8_e4m3fn
# Relative to the output's abs-max: the kernels sum in another order than the reference.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
PATHS = {"small": 1 << 30, "grouped": 0}
# Tiles that exercise several K steps and scale columns per GEMM.
GROUPED = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
SMALL = {
    # Rows: any power of two dividing 128 keeps a program's rows on one scale row; 32 and 16
    # rows still give each GEMV several scale rows (I = 384: 3, H = 256: 2), with fewer programs.
    "GATE_UP_BLOCK_N": 32,
    "GATE_UP_BLOCK_K": 256,  # two 128-column scale blocks a chunk
    "DOWN_BLOCK_E": 2,
    "DOWN_BLOCK_N": 16,
    "DOWN_BLOCK_K": 256,  # I = 384: the last chunk is half outside K (masked scales)
    "num_warps": 4,
    "num_stages": 2,
}


def fp8_experts(num_experts, rows, cols, gen):
    """FP8 codes [E, rows, cols] and per-block scales spanning two decades, so a wrong scale
    column or row changes the result."""
    codes = (torch.randn(num_experts, rows, cols, generator=gen) * 64).to(FP8)
    scale = torch.logspace(-4, -2, num_experts * (rows // 128) * (cols // 128))
    scale = scale[torch.randperm(scale.numel(), generator=gen)]
    return codes, scale.view(num_experts, rows // 128, cols // 128)


@pytest.mark.parametrize("path", ["small", "small_split", "grouped"])
@pytest.mark.parametrize("num_tokens", [1, 3, 33])
def test_fp8_experts_match_reference(path, num_tokens, dtype, device) -> None:
    """small_split: the down GEMV's choices on programs of their own, then summed."""
    if device.type == "cpu" and num_tokens == 33 and path != "grouped":
        # A program per token (no token tiles): 3 tokens run the same code; 25-30 s each here.
        pytest.skip("the interpreter's slowest cases: the CUDA run covers 33 tokens")
    hidden, inter, num_experts, top_k = 256, 384, 6, 2
    gen = torch.Generator().manual_seed(num_tokens)
    w13, s13 = fp8_experts(num_experts, 2 * inter, hidden, gen)
    w2, s2 = fp8_experts(num_experts, hidden, inter, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    weights, ids = weights.to(device), ids.to(device)
    w13, s13, w2, s2 = (t.to(device) for t in (w13, s13, w2, s2))
    out = fused_moe(
        x,
        w13,
        w2,
        weights,
        ids,
        config=GROUPED,
        small_config=SMALL
        | ({"DOWN_SPLIT": 1, "DOWN_BLOCK_E": 1} if path == "small_split" else {}),
        small_batch_max_tokens=PATHS[path.removesuffix("_split")],
        w13_scale=s13,
        w2_scale=s2,
    )
    expected = fused_moe_fp8_ref(x, w13, w2, weights, ids, s13, s2)
    assert out.dtype == dtype
    atol = TOLERANCE[dtype] * expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


def test_small_path_caps_fp8_tiles_at_one_scale_block(device) -> None:
    """GEMV tiles wider than 128 rows would span two scale rows: they are cut to 128."""
    hidden, inter, num_experts, top_k = 256, 384, 4, 2
    gen = torch.Generator().manual_seed(7)
    w13, s13 = fp8_experts(num_experts, 2 * inter, hidden, gen)
    w2, s2 = fp8_experts(num_experts, hidden, inter, gen)
    x = torch.randn(3, hidden, generator=gen).to(device)
    weights, ids = select_experts(torch.randn(3, num_experts, generator=gen), top_k, True)
    weights, ids = weights.to(device), ids.to(device)
    w13, s13, w2, s2 = (t.to(device) for t in (w13, s13, w2, s2))
    wide = SMALL | {"GATE_UP_BLOCK_N": 512, "DOWN_BLOCK_E": 1, "DOWN_BLOCK_N": 256}
    out = fused_moe(
        x,
        w13,
        w2,
        weights,
        ids,
        small_config=wide,
        small_batch_max_tokens=8,
        w13_scale=s13,
        w2_scale=s2,
    )
    expected = fused_moe_fp8_ref(x, w13, w2, weights, ids, s13, s2)
    torch.testing.assert_close(out, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)


def test_reference_dequantizes_per_block() -> None:
    gen = torch.Generator().manual_seed(0)
    w, s = fp8_experts(2, 256, 128, gen)
    full = dequantize_experts(w, s, torch.float32)
    torch.testing.assert_close(full[1, 130, 5], w[1, 130, 5].float() * s[1, 1, 0])
    x = torch.randn(3, 128, generator=gen)
    w2, s2 = fp8_experts(2, 128, 128, gen)
    weights, ids = select_experts(torch.randn(3, 2, generator=gen), 1, True)
    torch.testing.assert_close(
        fused_moe_fp8_ref(x, w, w2, weights, ids, s, s2),
        fused_moe_ref(x, full, dequantize_experts(w2, s2, torch.float32), weights, ids),
    )


def test_fp8_inputs_are_checked() -> None:
    gen = torch.Generator().manual_seed(1)
    w13, s13 = fp8_experts(2, 256, 128, gen)
    w2, s2 = fp8_experts(2, 128, 128, gen)
    x = torch.randn(2, 128)
    weights, ids = select_experts(torch.randn(2, 2), 1, True)
    with pytest.raises(ValueError, match="given together"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=s13)
    with pytest.raises(ValueError, match=r"w2_scale must be \[2, 1, 1\] float32"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2.double())
    with pytest.raises(ValueError, match="w13 must be contiguous .*float8_e4m3fn"):
        fused_moe(x, w13.float(), w2, weights, ids, w13_scale=s13, w2_scale=s2)
