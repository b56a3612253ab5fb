"""W8A8 fused MoE (FP8 experts x FP8 activations, `fused_moe_w8a8`) against `fused_moe_w8a8_ref`,
and the choice between it and the weight-only FP8 path. Under the CPU interpreter e4m3 dots run,
but its fp32 -> fp8 cast does not round to nearest (tests/utils/fp8_inputs.py): there the
reference quantizes with the Triton pass, which converts as the kernel's epilogue does; on CUDA
it quantizes with torch, and random bf16 inputs run at the model's shapes."""

from __future__ import annotations

import json

import pytest
import torch

from ferrum.kernels.device_properties import A100, H100, KNOWN_DEVICES, L40S
from ferrum.kernels.fp8_quant import Fp8GroupRows, per_token_group_quant_fp8
from ferrum.kernels.fp8_quant_ref import per_token_group_quant_fp8_ref
from ferrum.kernels.fp8_weight import quantize_weight_block
from ferrum.kernels.fused_moe import _runs_w8a8, fused_moe
from ferrum.kernels.fused_moe_config import (
    DEFAULT_SMALL,
    check_w8a8_config,
    load_tuned,
    save_section,
)
from ferrum.kernels.fused_moe_ref import fused_moe_fp8_ref, select_experts
from ferrum.kernels.fused_moe_rule import (
    W8A8_MIN_TOKENS,
    rule_buckets,
    uses_fp8_activations,
    w8a8_rule,
)
from ferrum.kernels.fused_moe_small_batch import SMALL_BATCH_MAX_TOKENS
from ferrum.kernels.fused_moe_w8a8_ref import fused_moe_w8a8_ref

ON_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not ON_CUDA, reason="needs CUDA (FP8 tensor cores)")
# Relative to the output's abs-max: fp32 sums in another order (Hopper's FP8 MMA keeps ~14
# mantissa bits a K step), and an act code may round the other way after that.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Several K steps a scale column (BLOCK_K 64); two groups a column tile with I = 384 ending half
# inside the second tile (BLOCK_N 256); a taller M tile.
CONFIGS = {
    "n128k64": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2},
    "n256k128": {"BLOCK_M": 32, "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2},
}


def fp8_experts(num_experts, rows, cols, gen):
    """FP8 codes [E, rows, cols] and per-block scales spanning two decades, so a wrong scale
    column or row changes the result."""
    codes = (torch.randn(num_experts, rows, cols, generator=gen) * 64).to(torch.float8_e4m3fn)
    scale = torch.logspace(-4, -2, num_experts * (rows // 128) * (cols // 128))
    scale = scale[torch.randperm(scale.numel(), generator=gen)]
    return codes, scale.view(num_experts, rows // 128, cols // 128)


def _quantize(device: torch.device):
    """The activation quantizer the reference uses (module docstring)."""
    return per_token_group_quant_fp8_ref if device.type == "cuda" else per_token_group_quant_fp8


def _problem(num_tokens, hidden, inter, num_experts, top_k, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13, s13 = fp8_experts(num_experts, 2 * inter, hidden, gen)
    w2, s2 = fp8_experts(num_experts, hidden, inter, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
    tensors = (x.to(dtype), w13, w2, weights, ids, s13, s2)
    return tuple(t.to(device) for t in tensors)


def _assert_close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    atol = TOLERANCE[expected.dtype] * expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


# (config, tokens, dtype): the interpreter's cost is the grid, so each config runs once on the CPU.
CASES = [
    ("n128k64", 9, torch.float32),
    ("n256k128", 21, torch.float16),
    pytest.param("n256k128", 21, torch.bfloat16, marks=cuda_only),
]


@pytest.mark.parametrize(("config", "num_tokens", "dtype"), CASES)
def test_w8a8_matches_reference(config, num_tokens, dtype, device) -> None:
    """Odd token counts, FP8 rows given (as the norm writes them) or quantized in the launcher
    (same bits), one pair routed to another rank's expert (-1: adds zero)."""
    x, w13, w2, weights, ids, s13, s2 = _problem(num_tokens, 256, 384, 4, 2, dtype, device)
    ids[1, 0] = -1
    run = dict(w13_scale=s13, w2_scale=s2, fp8_activations=True, w8a8_config=CONFIGS[config])
    out = fused_moe(x, w13, w2, weights, ids, **run)
    expected = fused_moe_w8a8_ref(x, w13, w2, weights, ids, s13, s2, _quantize(device))
    _assert_close(out, expected)
    rows = Fp8GroupRows(*per_token_group_quant_fp8(x))
    assert torch.equal(fused_moe(x, w13, w2, weights, ids, x_fp8=rows, **run), out)


def test_w8a8_rule_tiles_run(device) -> None:
    """The launcher's own config (no w8a8_config): the CPU's default, the device's rule."""
    x, w13, w2, weights, ids, s13, s2 = _problem(9, 128, 256, 4, 2, torch.float32, device, 1)
    out = fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, fp8_activations=True)
    _assert_close(out, fused_moe_w8a8_ref(x, w13, w2, weights, ids, s13, s2, _quantize(device)))


def test_path_choice_by_device_and_token_count() -> None:
    assert W8A8_MIN_TOKENS > SMALL_BATCH_MAX_TOKENS  # the GEMV path stays weight-only
    assert not uses_fp8_activations(W8A8_MIN_TOKENS - 1, H100)
    assert uses_fp8_activations(W8A8_MIN_TOKENS, H100)
    assert uses_fp8_activations(8192, L40S)  # sm89
    assert not uses_fp8_activations(8192, A100)  # sm80: no FP8 tensor cores, weight-only
    assert not uses_fp8_activations(8192, None)  # off CUDA: the rule never picks W8A8
    assert uses_fp8_activations(1, H100, forced=True)
    assert not uses_fp8_activations(8192, H100, forced=False)
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        uses_fp8_activations(64, A100, forced=True)
    # A weight-only path's tiles or limit given (benchmarks, the tuner, batch-invariant mode)
    # pin that path; bf16 experts never run W8A8.
    assert _runs_w8a8(64, H100, True, None, weight_only_path=False)
    assert not _runs_w8a8(64, H100, True, None, weight_only_path=True)
    assert not _runs_w8a8(64, H100, False, None, weight_only_path=False)


def test_w8a8_arguments_are_checked() -> None:
    """No kernel runs: each call is refused before the launch."""
    x, w13, w2, weights, ids, s13, s2 = _problem(4, 128, 128, 2, 1, torch.float32, "cpu")
    rows = Fp8GroupRows(*per_token_group_quant_fp8_ref(x))
    with pytest.raises(ValueError, match="needs FP8 experts"):
        fused_moe(x, w13.float(), w2.float(), weights, ids, fp8_activations=True)
    with pytest.raises(ValueError, match="pick a weight-only path"):
        fused_moe(x, w13, w2, weights, ids, config=CONFIGS["n128k64"], fp8_activations=True,
                  w13_scale=s13, w2_scale=s2)  # fmt: skip
    with pytest.raises(ValueError, match="runs weight-only"):  # the CPU rule: weight-only
        fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2, x_fp8=rows)
    bad_rows = Fp8GroupRows(rows.q[:2], rows.scales[:2])
    run = dict(w13_scale=s13, w2_scale=s2, fp8_activations=True)
    with pytest.raises(ValueError, match="x_fp8 must be"):
        fused_moe(x, w13, w2, weights, ids, x_fp8=bad_rows, **run)
    narrow = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}
    with pytest.raises(ValueError, match="BLOCK_N must be a multiple of 128"):
        fused_moe(x, w13, w2, weights, ids, w8a8_config=narrow, **run)


def test_w8a8_rule_fits_every_known_gpu() -> None:
    """Whole groups a column tile, one scale column a K step, stages within shared memory (the
    gate/up GEMM's: an activation tile and two weight tiles a stage, 1 byte each)."""
    for device in KNOWN_DEVICES.values():
        for t, c in rule_buckets("grouped_w8a8", 128, 768, 2048, 8, device).items():
            check_w8a8_config(c, f"{device.name} T<={t}")
            stage = c["BLOCK_K"] * (c["BLOCK_M"] + 2 * c["BLOCK_N"])
            assert stage * c["num_stages"] <= device.shared_memory_per_block, (device, t, c)
    small, large = w8a8_rule(64, 128, 768, 2048, 8, H100), w8a8_rule(8192, 128, 768, 2048, 8, H100)
    assert small["BLOCK_M"] < large["BLOCK_M"] == 128
    assert w8a8_rule(8192, 128, 768, 2048, 8, L40S)["num_stages"] < large["num_stages"]


def test_w8a8_section_format(tmp_path) -> None:
    """`grouped_w8a8` lives in the FP8 experts' file, with W8A8's own limits checked on write
    and on read; the other sections of the file stay."""
    good = {64: {"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}}
    folder = tmp_path / "fused_moe_configs"
    with pytest.raises(ValueError, match="fp8=True"):
        save_section(8, 128, 256, "GPU", "grouped_w8a8", good, folder)
    save_section(8, 128, 256, "GPU", "small", {1: DEFAULT_SMALL[2]}, folder, fp8=True)
    path = save_section(8, 128, 256, "GPU", "grouped_w8a8", good, folder, fp8=True)
    data = json.loads(path.read_text())
    assert set(data) == {"small", "grouped_w8a8"} and data["grouped_w8a8"]["64"] == good[64]
    data["grouped_w8a8"]["64"]["BLOCK_N"] = 64
    path.write_text(json.dumps(data))
    load_tuned.cache_clear()
    with pytest.raises(ValueError, match="BLOCK_N must be a multiple of 128"):
        load_tuned(8, 128, 256, "GPU", True, tmp_path)
    load_tuned.cache_clear()


@cuda_only
@pytest.mark.parametrize("num_tokens", [16, 64, 300, 2048])
def test_w8a8_random_bf16_at_model_shapes(num_tokens) -> None:
    """Qwen3-30B-A3B's expert shapes (fewer experts), the rule's tiles, torch's FP8 conversion;
    and W8A8 stays near the weight-only result (what activation quantization costs)."""
    device, hidden, inter, num_experts, top_k = torch.device("cuda"), 2048, 768, 32, 8
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    experts = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        w = torch.randn(num_experts, rows, cols, device=device, generator=gen) * 0.02
        pairs = [quantize_weight_block(w[e]) for e in range(num_experts)]
        experts += [torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])]
    w13, s13, w2, s2 = experts
    x = torch.randn(num_tokens, hidden, device=device, generator=gen).to(torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, device=device, generator=gen)
    weights, ids = select_experts(logits, top_k, True)
    out = fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2)  # the rule: W8A8
    _assert_close(out, fused_moe_w8a8_ref(x, w13, w2, weights, ids, s13, s2))
    weight_only = fused_moe_fp8_ref(x, w13, w2, weights, ids, s13, s2)
    error = (out.float() - weight_only.float()).norm() / weight_only.float().norm()
    assert error < 0.08, error


def test_w8a8_tiles_triton_cannot_build_are_refused() -> None:
    """BLOCK_N 384 (three whole groups) and BLOCK_K 96 (within 32..128) are not powers of two:
    tl.arange could not build them, so a tuned table holding one is refused when read."""
    base = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    check_w8a8_config(base, "ok")
    with pytest.raises(ValueError, match="BLOCK_N"):
        check_w8a8_config({**base, "BLOCK_N": 384}, "t")
    with pytest.raises(ValueError, match="BLOCK_K"):
        check_w8a8_config({**base, "BLOCK_K": 96}, "t")
