"""`ferrum tune`'s compile pool: before a task's candidates are timed, worker processes run each
once (`warm_candidate`), so Triton compiles them in parallel into its on-disk cache and the
timer, one candidate after another, loads them from there. A candidate's first run compiles it
(hundreds of ms to seconds); its timing takes tens of ms, so on a fresh machine compiling is
most of a tuning run.

The workers are idle while the timer runs: a kernel of another process on the GPU would
share it with the timed graph. A worker that fails on a candidate reports it and goes on (the
timer meets the same failure and counts it); if a worker process dies the pool closes, and
the run goes on compiling in the timer's process."""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

from ferrum.bench.tune_shapes import LinearShape, MoEShape, TuneTask
from ferrum.bench.tune_store import Config

# Workers when --compile-workers is not given: one core is left to the timer's process, and
# the workers together hold at most half the GPU's memory (a CUDA context and one copy of the
# largest shape's weights each, WORKER_CONTEXT_BYTES + `shape_bytes`).
MAX_DEFAULT_WORKERS = 8
WORKER_CONTEXT_BYTES = 1 << 30
_worker_bench: Any = None


def shape_bytes(shape: LinearShape | MoEShape) -> int:
    """A bound on the bytes of one copy of a shape's operands while they are made (bf16, and
    FP8 quantized from bf16)."""
    if isinstance(shape, LinearShape):
        return 3 * shape.n * shape.k
    return 9 * shape.num_experts * shape.inter * shape.hidden


def default_compile_workers(shapes: Sequence[LinearShape | MoEShape], gpu_memory_bytes: int) -> int:
    per_worker = WORKER_CONTEXT_BYTES + max((shape_bytes(s) for s in shapes), default=0)
    by_memory = gpu_memory_bytes // 2 // per_worker
    return max(0, min(MAX_DEFAULT_WORKERS, (os.cpu_count() or 1) - 1, by_memory))


def start_bench(make_bench: Callable[..., Any], *args: Any) -> None:
    """A worker's initializer: the bench (operands on its GPU) its candidates run on."""
    global _worker_bench
    _worker_bench = make_bench(*args)


def warm_candidate(item: tuple[TuneTask, Config]) -> str | None:
    """Runs one candidate once in a worker (compiling it); None, or why it failed."""
    from ferrum.bench.tune_gpu import warm_run

    try:
        warm_run(_worker_bench, *item)
    except Exception as e:  # the timer meets it again and counts it
        return f"{type(e).__name__}: {e}"
    return None


class CompilePool:
    """`workers` spawned processes, each with `make_bench(*bench_args)`; `warm(task, configs)`
    runs `work((task, config))` for every config across them and returns when all are done."""

    def __init__(
        self,
        workers: int,
        make_bench: Callable[..., Any],
        bench_args: Sequence[Any],
        work: Callable[[tuple[TuneTask, Config]], str | None] = warm_candidate,
    ) -> None:
        self.work = work
        self.executor: futures.ProcessPoolExecutor | None = futures.ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=start_bench,
            initargs=(make_bench, *bench_args),
        )

    def warm(self, task: TuneTask, configs: Sequence[Config]) -> list[str | None]:
        """Each config's failure (None: it ran); all None once the pool has closed."""
        if self.executor is None:
            return [None] * len(configs)
        try:
            return list(self.executor.map(self.work, [(task, c) for c in configs]))
        except futures.process.BrokenProcessPool:
            self.close()
            return [None] * len(configs)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.executor = None
