"""The calls `ferrum tune` times (tune_gpu.run_fn), built on the CPU in fp16 and run once under
the Triton interpreter: every candidate of a task sees the same operands, so candidates of one
task compute the same op (the GEMV as F.linear; the FP8 linear through any bucket; the fused MoE
on either path, bf16 or FP8 experts) within rounding."""

from __future__ import annotations

import pytest
import torch

from ferrum.bench.tune_gpu import GpuBench, run_fn
from ferrum.bench.tune_ops import candidates
from ferrum.bench.tune_shapes import LinearShape, MoEShape, TuneTask
from ferrum.kernels.device_properties import L40S

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build of the calls")


def _bench(fp8: bool) -> GpuBench:
    return GpuBench(L40S, fp8, torch_device="cpu", dtype=torch.float16)


def _same(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    scale = b.float().abs().max().item()
    assert a.shape == b.shape and scale > 0
    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol * scale)


def test_gemv_candidates_match_f_linear() -> None:
    bench, task = _bench(False), TuneTask("gemv", LinearShape(48, 256), 1)
    found = candidates(task, L40S)
    assert found[0] is None  # F.linear
    fn, num_copies = run_fn(bench, task, found[0])
    assert num_copies > 1  # a 24 KB weight: copies enough to stream past the L2 cache
    tile = next(c for c in found[1:] if c.BLOCK_N == 2 and c.BLOCK_K == 512)
    _same(run_fn(bench, task, tile)[0](1), fn(1), 2e-3)


def test_gemv_rows_candidates_match_f_linear() -> None:
    bench, task = _bench(False), TuneTask("gemv_rows", LinearShape(96, 512), 4)
    found = candidates(task, L40S)
    reference = run_fn(bench, task, found[0])[0](0)  # F.linear
    assert reference.shape == (4, 96)
    for tile in (found[1], next(c for c in found if c and c.SPLIT_K == 2)):
        _same(run_fn(bench, task, tile)[0](0), reference, 2e-3)


def test_a_wrong_gemv_candidate_is_refused_before_it_is_timed(monkeypatch) -> None:
    """A tile whose output is off (a miscompile on some GPU) raises, which the tuner counts as
    a failed candidate, so it can never be the fastest."""
    import ferrum.bench.tune_gpu as tune_gpu

    monkeypatch.setattr(tune_gpu, "gemv_rows", lambda x, w, tile: x.new_zeros(x.shape[0], 96))
    bench, task = _bench(False), TuneTask("gemv_rows", LinearShape(96, 512), 4)
    with pytest.raises(ValueError, match="against F.linear"):
        run_fn(bench, task, candidates(task, L40S)[1])


def test_fp8_linear_candidates_agree() -> None:
    bench = _bench(True)
    task = TuneTask("fp8_gemm", LinearShape(128, 1024), 5)
    found = candidates(task, L40S)
    split = next(c for c in found if c.SPLIT_K == 2 and c.BLOCK_M == 16)
    wide = next(c for c in found if c.SPLIT_K == 1 and c.BLOCK_M == 64 and c.BLOCK_N == 128)
    out = run_fn(bench, task, split)[0](0)
    assert out.dtype == torch.float16
    _same(out, run_fn(bench, task, wide)[0](0), 4e-3)
    gemv_task = TuneTask("fp8_gemm", LinearShape(128, 256), 1)
    assert run_fn(bench, gemv_task, candidates(gemv_task, L40S)[0])[0](0).shape == (1, 128)


@pytest.mark.parametrize(("op", "num_tokens"), [("moe_small", 2), ("moe_grouped", 12)])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-experts", "fp8-experts"])
def test_moe_candidates_agree(op, num_tokens, fp8) -> None:
    bench = _bench(fp8)
    task = TuneTask(op, MoEShape(4, 128, 128, 2), num_tokens)
    found = candidates(task, L40S)
    fn, num_routings = run_fn(bench, task, found[0])
    other = found[-1] if op == "moe_grouped" else next(c for c in found if c["DOWN_SPLIT"])
    _same(run_fn(bench, task, other)[0](num_routings - 1), fn(num_routings - 1), 4e-3)


def test_moe_w8a8_candidates_agree() -> None:
    """Two W8A8 tiles of one K step (the same fp32 sums): a short one and one twice as wide as
    the intermediate size."""
    bench = _bench(True)
    task = TuneTask("moe_w8a8", MoEShape(4, 128, 128, 2), 12)
    found = candidates(task, L40S)
    short = next(c for c in found if c["BLOCK_N"] == 128 and c["BLOCK_K"] == 64)
    wide = next(c for c in found if (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) == (32, 256, 64))
    fn, num_routings = run_fn(bench, task, short)
    _same(run_fn(bench, task, wide)[0](num_routings - 1), fn(num_routings - 1), 4e-3)
