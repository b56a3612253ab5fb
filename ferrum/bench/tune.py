"""`ferrum tune`'s run (tune_args defines the command): plans the tasks from the flags, measures
each on the GPU (tune_ops' candidates, tune_gpu's timer) and records the fastest (tune_store)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tqdm import tqdm

from ferrum.bench.tune_args import default_ops
from ferrum.bench.tune_ops import candidates
from ferrum.bench.tune_shapes import (
    LinearShape,
    MoEShape,
    TuneTask,
    build_tasks,
    lm_head_shape,
    model_shapes,
    parse_shape,
)
from ferrum.bench.tune_store import Config, TuneStore
from ferrum.bench.tune_warm import breaks_the_context

TimeFn = Callable[[TuneTask, Config], float]
CandidatesFn = Callable[[TuneTask], list[Config]]
WarmFn = Callable[[TuneTask, list[Config]], list[str | None]]


@dataclass(frozen=True, slots=True)
class TunePlan:
    ops: tuple[str, ...]
    linear: list[LinearShape]
    moe: list[MoEShape]
    batch_sizes: tuple[int, ...]

    def tasks(self) -> list[TuneTask]:
        return build_tasks(self.ops, self.linear, self.moe, self.batch_sizes)


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        values = ()
    if not values or values[0] < 1:
        raise ValueError(f"{flag}: expected a comma list of positive integers, got {text!r}")
    return values


def plan_from_args(args: argparse.Namespace, fp8_tensor_cores: bool = False) -> TunePlan:
    """The ops, shapes and batches the flags ask for (ValueError naming the flag otherwise);
    `fp8_tensor_cores`: whether the GPU has them (`default_ops`)."""
    ops = tuple(args.ops.split(",")) if args.ops else default_ops(args.dtype, fp8_tensor_cores)
    for op in ("fp8_gemm", "moe_w8a8"):
        if args.dtype == "bf16" and op in ops:
            raise ValueError(f"--ops: {op} measures FP8 weights: use --dtype fp8")
    linear: list[LinearShape] = []
    moe: list[MoEShape] = []
    if args.model:
        from ferrum.model_arch import ModelArchConfig
        from ferrum.model_folder import read_hf_config

        arch = ModelArchConfig.from_hf_config(read_hf_config(args.model))
        linear, moe = model_shapes(arch, args.tensor_parallel_size)
        if args.dtype == "bf16":
            linear.append(lm_head_shape(arch, args.tensor_parallel_size))
    for text in args.shape:
        shape = parse_shape(text)
        (linear if isinstance(shape, LinearShape) else moe).append(shape)  # type: ignore[arg-type]
    if not linear and not moe:
        raise ValueError("give a model folder or --shape")
    batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
    return TunePlan(ops, list(dict.fromkeys(linear)), list(dict.fromkeys(moe)), batch_sizes)


def run_tuning(
    tasks: Iterable[TuneTask],
    store: TuneStore,
    candidates_fn: CandidatesFn,
    time_fn: TimeFn,
    show_progress: bool = True,
    warm_fn: WarmFn | None = None,
) -> dict[str, int]:
    """Measures every task the store does not hold yet and records the fastest candidate of
    each (a candidate that raises, e.g. a tile the compiler refuses, is counted and skipped);
    `warm_fn(task, configs)` first, when given (tune_warm's compile pool; a candidate that
    broke a worker's CUDA context is not timed). Returns counts: measured, skipped (already
    measured), empty (no candidate ran), failed."""
    tasks = list(tasks)
    todo = [t for t in tasks if not store.measured(t)]
    counts = {"measured": 0, "skipped": len(tasks) - len(todo), "empty": 0, "failed": 0}
    bar = tqdm(todo, desc="ferrum tune", unit="task", disable=not show_progress)
    for task in bar:
        configs = candidates_fn(task)
        failures = [None] * len(configs) if warm_fn is None else warm_fn(task, configs)
        best: tuple[float, Config] | None = None
        for config, failure in zip(configs, failures, strict=True):
            if breaks_the_context(failure):
                counts["failed"] += 1
                bar.write(f"{task.key}: {config} broke a compile worker: {failure}"[:300])
                continue
            try:
                us = time_fn(task, config)
            except Exception as e:  # a tile the compiler or the kernel refuses
                counts["failed"] += 1
                bar.write(f"{task.key}: {config} failed: {type(e).__name__}: {e}"[:300])
                continue
            if best is None or us < best[0]:
                best = (us, config)
        if best is None:
            counts["empty"] += 1
            bar.write(f"{task.key}: no candidate ran ({len(configs)} tried); not recorded")
            continue
        store.record(task, best[1], best[0], len(configs))
        counts["measured"] += 1
        bar.set_postfix_str(f"{task.key} {best[0]:.1f} us")
    return counts


def main(args: argparse.Namespace) -> int:
    import functools

    import torch

    from ferrum import envs
    from ferrum.bench.tune_gpu import GpuBench
    from ferrum.bench.tune_warm import CompilePool, default_compile_workers
    from ferrum.kernels.device_properties import device_properties

    plan_from_args(args)  # bad flags are named before the GPU is looked for
    if not torch.cuda.is_available():
        raise ValueError(
            "ferrum tune times kernels on a CUDA GPU, and this machine has none visible "
            "(torch.cuda.is_available() is False); run it on the GPU the tables are for"
        )
    device = device_properties(torch.device("cuda"))
    assert device is not None
    plan = plan_from_args(args, device.has_fp8_tensor_cores)
    folder = args.tuned_config_dir or envs.tuned_config_dir()
    fp8 = args.dtype == "fp8"
    store = TuneStore(folder, device, fp8, args.scale_format)
    store.write_all()
    print(f"{device.name}: {len(plan.tasks())} tasks, results in {folder}")
    bench = GpuBench(device, fp8, args.scale_format, args.iters, args.repeats)
    workers = args.compile_workers
    if workers is None:
        free_memory, _ = torch.cuda.mem_get_info()
        workers = default_compile_workers([*plan.linear, *plan.moe], free_memory)
    pool = None
    if workers > 0:  # one weight copy a worker: it only compiles
        warm_bench = functools.partial(GpuBench, max_copies=1)
        pool = CompilePool(workers, warm_bench, (device, fp8, args.scale_format))
    try:
        counts = run_tuning(
            plan.tasks(), store, lambda task: candidates(task, device, args.scale_format), bench,
            warm_fn=None if pool is None else pool.warm,
        )  # fmt: skip
    finally:
        if pool is not None:
            if pool.closed_because is not None:
                print(f"compile workers stopped ({pool.closed_because}); compiled while timing")
            pool.close()
    print(", ".join(f"{n} {what}" for what, n in counts.items()))
    for path in store.write_all():
        print(f"wrote {path}")
    return 0
