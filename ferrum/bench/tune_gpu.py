"""`ferrum tune`'s timer on the GPU (`GpuBench(task, config) -> microseconds`). A candidate runs
as the engine runs it: the bf16 GEMV or F.linear at one row, the FP8 linear with the candidate as
its only bucket, the fused MoE with it as its grouped, small-batch or W8A8 config (W8A8 quantizing
the activations in the launcher, where the engine's norm writes them), over random operands
(weights N(0, 0.02), activations N(0, 1), routing the top-k of random logits); timed as a CUDA
graph of `iters` calls (and at least one per copy) cycling over weight copies (together twice the
L2 cache, so calls stream from HBM) or MoE routings, replayed `repeats` times after a warm-up,
each replay between two CUDA events: the median microseconds a call."""

from __future__ import annotations

import statistics
import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ferrum.bench.tune_shapes import LinearShape, MoEShape, TuneTask
from ferrum.bench.tune_store import Config
from ferrum.kernels.device_properties import DeviceProperties
from ferrum.kernels.fp8_gemm_config import Fp8GemmConfig
from ferrum.kernels.fp8_linear import fp8_block_linear, fp8_channel_linear
from ferrum.kernels.fp8_weight import quantize_weight_block, quantize_weight_per_channel
from ferrum.kernels.fused_moe import fused_moe
from ferrum.kernels.fused_moe_small_batch import SMALL_BATCH_MAX_TOKENS
from ferrum.kernels.gemv import gemv
from ferrum.kernels.gemv_config import GemvTile
from ferrum.kernels.gemv_rows import GemvRowsTile, gemv_rows
from ferrum.kernels.tile_rules import cdiv

# Weight copies at most (a tiny weight's copies together still pass twice the L2 cache).
MAX_COPIES = 256
# Routings a MoE candidate cycles over, so that consecutive calls read other experts.
NUM_ROUTINGS = 8
RunFn = Callable[[int], object]
# A bucket bound above any batch: the candidate serves every row count.
_EVERY_BATCH = 1 << 62


def graph_time_us(fn: Callable[[int], object], num_copies: int, iters: int, repeats: int) -> float:
    """Median GPU microseconds a call of fn(i) (module docstring); one untimed call per copy
    first compiles and warms up."""
    for i in range(num_copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i % num_copies)
    graph.replay()
    torch.cuda.synchronize()
    return median_replay_ms(graph, repeats) * 1e3 / iters


def median_replay_ms(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    """Median milliseconds of `repeats` replays of a captured graph, timed one at a time."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class GpuBench:
    """Times candidates on the current GPU (`__call__(task, config) -> microseconds`), building
    each shape's operands once: bf16 activations, weights bf16 or FP8 (`fp8`, `scale_format`)."""

    def __init__(
        self,
        device: DeviceProperties,
        fp8: bool,
        scale_format: str = "block",
        iters: int = 20,
        repeats: int = 5,
        torch_device: str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        max_copies: int = MAX_COPIES,
    ) -> None:
        self.device = device
        self.max_copies = max_copies
        self.fp8 = fp8
        self.scale_format = scale_format
        self.iters = iters
        self.repeats = repeats
        # Where operands live and the activations' dtype (the CPU and fp16: tests, under the
        # Triton interpreter, which has no bf16).
        self.torch_device = torch_device
        self.dtype = dtype
        self._weights: dict[tuple[str, object], list[tuple[torch.Tensor, ...]]] = {}
        self._gen = torch.Generator(device=torch_device).manual_seed(0)

    def _copies(self, weight_bytes: int) -> int:
        """Copies whose bytes together pass twice the L2 cache (one at least, max_copies most)."""
        wanted = cdiv(2 * self.device.l2_cache_bytes, max(1, weight_bytes))
        return max(1, min(self.max_copies, wanted))

    def randn(self, *shape: int, generator: torch.Generator | None = None) -> torch.Tensor:
        gen = self._gen if generator is None else generator
        return torch.randn(*shape, device=self.torch_device, dtype=self.dtype, generator=gen)

    def task_generator(self, task: TuneTask) -> torch.Generator:
        """A generator seeded by the task: every candidate of a task gets the same activations
        and routings."""
        seed = zlib.crc32(task.key.encode())
        return torch.Generator(device=self.torch_device).manual_seed(seed)

    def __call__(self, task: TuneTask, config: Config) -> float:
        fn, num_copies = run_fn(self, task, config)
        # A replay touches every copy, so the next one finds none of them in L2.
        return graph_time_us(fn, num_copies, max(self.iters, num_copies), self.repeats)

    def weights(self, op: str, shape: object, make: Callable[[], tuple[torch.Tensor, ...]],
                weight_bytes: int) -> list[tuple[torch.Tensor, ...]]:  # fmt: skip
        """The shape's weight copies (made once): `make()` a copy."""
        key = (op, shape)
        if key not in self._weights:
            self._weights.clear()  # one shape's operands on the GPU at a time
            if self.torch_device == "cuda":
                torch.cuda.empty_cache()
            self._weights[key] = [make() for _ in range(self._copies(weight_bytes))]
        return self._weights[key]


def warm_run(bench: GpuBench, task: TuneTask, config: Config) -> None:
    """Runs a candidate once, as the timer's first call does: compiles it (tune_warm's pool)."""
    fn, _ = run_fn(bench, task, config)
    fn(0)
    if bench.torch_device == "cuda":
        torch.cuda.synchronize()


def run_fn(bench: GpuBench, task: TuneTask, config: Config) -> tuple[RunFn, int]:
    """(fn(i) running the candidate on weight copy i, number of copies)."""
    if task.op in ("gemv", "gemv_rows"):
        return _gemv_fn(bench, task, config)
    if task.op == "fp8_gemm":
        assert isinstance(config, Fp8GemmConfig)
        return _fp8_linear_fn(bench, task, config)
    assert isinstance(config, dict)
    return _moe_fn(bench, task, config)


def _gemv_fn(bench: GpuBench, task: TuneTask, tile: Config) -> tuple[RunFn, int]:
    shape = task.shape
    assert isinstance(shape, LinearShape)
    weights = bench.weights(
        "gemv", shape, lambda: (bench.randn(shape.n, shape.k) * 0.02,), 2 * shape.n * shape.k
    )
    x = bench.randn(task.m, shape.k, generator=bench.task_generator(task))
    if tile is None:
        return (lambda i: F.linear(x, weights[i][0])), len(weights)
    if isinstance(tile, GemvRowsTile):

        def fn(i: int) -> torch.Tensor:
            return gemv_rows(x, weights[i][0], tile)

    else:
        assert isinstance(tile, GemvTile)
        args = (tile.BLOCK_N, tile.BLOCK_K, tile.num_warps, tile.num_stages)

        def fn(i: int) -> torch.Tensor:
            return gemv(x, weights[i][0], *args)

    _check_against_f_linear(fn(0), x, weights[0][0], tile)
    return fn, len(weights)


def _check_against_f_linear(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, tile: Config
) -> None:
    """A ValueError (the tuner counts the candidate as failed) unless a GEMV candidate's output
    is within 1% of the largest value of F.linear's in fp32: a miscompiled tile never wins."""
    expected = F.linear(x.float(), w.float())
    err = (got.float() - expected).abs().max().item()
    if not err <= 0.01 * expected.abs().max().item():
        raise ValueError(f"{tile}: max abs error {err:.3g} against F.linear")


def _fp8_linear_fn(bench: GpuBench, task: TuneTask, config: Fp8GemmConfig) -> tuple[RunFn, int]:
    shape, m = task.shape, task.m
    assert isinstance(shape, LinearShape)
    block = bench.scale_format == "block"
    quantize = quantize_weight_block if block else quantize_weight_per_channel
    weights = bench.weights(
        f"fp8_{bench.scale_format}",
        shape,
        lambda: quantize(bench.randn(shape.n, shape.k) * 0.02),
        shape.n * shape.k,
    )
    x = bench.randn(m, shape.k, generator=bench.task_generator(task))
    linear = fp8_block_linear if block else fp8_channel_linear
    buckets = {_EVERY_BATCH: config}
    return (lambda i: linear(x, *weights[i], buckets=buckets)), len(weights)


def _expert_weights(bench: GpuBench, shape: MoEShape) -> tuple[torch.Tensor, ...]:
    """(w13, w2) in bf16, or (w13, w2, w13_scale, w2_scale) FP8 with 128x128 block scales."""
    e, i, h = shape.num_experts, shape.inter, shape.hidden
    w13, w2 = bench.randn(e, 2 * i, h) * 0.02, bench.randn(e, h, i) * 0.02
    if not bench.fp8:
        return w13, w2
    out = []
    for w in (w13, w2):
        pairs = [quantize_weight_block(w[x]) for x in range(e)]
        out.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))
    return out[0][0], out[1][0], out[0][1], out[1][1]


def _moe_fn(bench: GpuBench, task: TuneTask, config: dict[str, int]) -> tuple[RunFn, int]:
    shape, num_tokens, small = task.shape, task.m, task.op == "moe_small"
    assert isinstance(shape, MoEShape)
    e, i, h = shape.num_experts, shape.inter, shape.hidden
    # One copy: the experts of a batch are spread over all of them (routings vary instead).
    size = max(3 * e * i * h, 2 * bench.device.l2_cache_bytes)
    experts = bench.weights("moe_fp8" if bench.fp8 else "moe", shape,
                            lambda: _expert_weights(bench, shape), size)[0]  # fmt: skip
    gen = bench.task_generator(task)
    routings = []
    for _ in range(NUM_ROUTINGS):
        logits = torch.randn(num_tokens, e, device=bench.torch_device, generator=gen)
        weights, ids = torch.topk(torch.softmax(logits, -1), shape.top_k, -1)
        routings.append((bench.randn(num_tokens, h, generator=gen), weights, ids.to(torch.int32)))
    scales = {}
    if bench.fp8:
        scales = {"w13_scale": experts[2], "w2_scale": experts[3]}
    if task.op == "moe_w8a8":
        kwargs = {"w8a8_config": config, "fp8_activations": True}
    elif small:
        kwargs = {"small_config": config, "small_batch_max_tokens": SMALL_BATCH_MAX_TOKENS}
    else:
        kwargs = {"config": config, "small_batch_max_tokens": 0}

    def run(r: int) -> object:
        hidden, weights, ids = routings[r]
        return fused_moe(hidden, experts[0], experts[1], weights, ids, **kwargs, **scales)

    return run, NUM_ROUTINGS
