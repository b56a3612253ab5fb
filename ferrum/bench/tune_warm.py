"""`ferrum tune`'s compile pool: before a task's candidates are timed, worker processes run each
once (`warm_candidate`), so Triton compiles them in parallel into its on-disk cache and the
timer, one candidate after another, loads them from there. A candidate's first run compiles it
(hundreds of ms to seconds); its timing takes tens of ms, so on a fresh machine compiling is
most of a tuning run.

The workers are idle while the timer runs: a kernel of another process on the GPU would
share it with the timed graph. A worker that fails on a candidate reports it and goes on (the
timer meets the same failure and counts it). The pool closes, its processes ended before the
timer goes on, and the run goes on compiling in the timer's process, when a worker dies, when
one reports a CUDA error or runs out of memory (its context may be unusable), or when a task's
warm-up outlasts WARM_TIMEOUT_S; `closed_because` says which."""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from ferrum.bench.tune_shapes import LinearShape, MoEShape, TuneTask
from ferrum.bench.tune_store import Config

# Workers when --compile-workers is not given: one core is left to the timer's process, and
# the workers together take at most half the GPU's free memory (a CUDA context and the peak of
# making the largest shape's operands each, WORKER_CONTEXT_BYTES + `shape_bytes`).
MAX_DEFAULT_WORKERS = 8
WORKER_CONTEXT_BYTES = 1 << 30
# A task's warm-up past this is taken for a hung worker (a compile takes seconds).
WARM_TIMEOUT_S = 900.0
# A worker's failure that may leave its CUDA context unusable (torch's and Triton's launcher's
# words for a CUDA error, and a lack of memory).
FATAL_FAILURES = ("CUDA error", "Triton Error [CUDA]", "illegal memory access", "out of memory")


def is_fatal(failure: str | None) -> bool:
    return bool(failure) and any(words in failure for words in FATAL_FAILURES)


def breaks_the_context(failure: str | None) -> bool:
    """Whether a candidate's failure in a worker was a CUDA error of its own (not a lack of
    memory): timing it would break the timer's context too, so the tuner skips it."""
    return is_fatal(failure) and "out of memory" not in failure


_worker_bench: Any = None


def shape_bytes(shape: LinearShape | MoEShape) -> int:
    """A bound on the peak bytes of making one copy of a shape's operands: bf16 weights, and
    for FP8 their quantization's fp32 temporaries, codes and stacked copies."""
    if isinstance(shape, LinearShape):
        return 16 * shape.n * shape.k
    return 16 * shape.num_experts * shape.inter * shape.hidden


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_compile_workers(
    shapes: Sequence[LinearShape | MoEShape], free_gpu_memory_bytes: int
) -> int:
    per_worker = WORKER_CONTEXT_BYTES + max((shape_bytes(s) for s in shapes), default=0)
    by_memory = free_gpu_memory_bytes // 2 // per_worker
    return max(0, min(MAX_DEFAULT_WORKERS, usable_cores() - 1, by_memory))


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
    finally:
        _release_cached_memory()
    return None


def _release_cached_memory() -> None:
    """Returns the temporaries of making operands to the GPU: the timer needs the room."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class CompilePool:
    """`workers` spawned processes, each with `make_bench(*bench_args)`; `warm(task, configs)`
    runs `work((task, config))` for every config across them and returns when all are done."""

    def __init__(
        self,
        workers: int,
        make_bench: Callable[..., Any],
        bench_args: Sequence[Any],
        work: Callable[[tuple[TuneTask, Config]], str | None] = warm_candidate,
        timeout_s: float = WARM_TIMEOUT_S,
    ) -> None:
        self.work = work
        self.timeout_s = timeout_s
        self.closed_because: str | None = None
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
        items = [(task, c) for c in configs]
        try:
            failures = list(self.executor.map(self.work, items, timeout=self.timeout_s))
        except futures.process.BrokenProcessPool:
            self.close("a worker process died")
            return [None] * len(configs)
        except futures.TimeoutError:
            self.close(f"{task.key}'s warm-up took over {self.timeout_s:.0f} s")
            return [None] * len(configs)
        fatal = next((f for f in failures if is_fatal(f)), None)
        if fatal is not None:
            self.close(f"a worker failed on {task.key}: {fatal[:200]}")
        return failures

    def close(self, because: str = "closed") -> None:
        """Ends the workers, a busy or hung one too, before returning."""
        if self.executor is None:
            return
        if self.closed_because is None and because != "closed":
            self.closed_because = because
        # The executor's own processes (no public handle): a busy one is not ended by shutdown.
        processes = list((getattr(self.executor, "_processes", None) or {}).values())
        self.executor.shutdown(wait=False, cancel_futures=True)
        _end(processes)
        self.executor = None


def _end(processes: Sequence[Any], within_s: float = 30.0) -> None:
    """Terminates the processes and waits until each has been reaped. A join can return
    before its process is reaped (its sentinel closes just before the kernel makes it a
    zombie, or the executor's own thread reaps it first), so it waits on `exitcode`."""
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + within_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        while process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if process.exitcode is None:
            process.kill()
            process.join(timeout=5)
