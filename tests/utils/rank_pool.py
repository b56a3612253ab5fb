"""A pool of worker processes joined into one tensor-parallel group (gloo; NCCL on GPUs), shared
by tests.

Starting torch processes costs seconds on the CI's two cores, so one pool serves a whole test
module (the gloo one, fixture `gloo_ranks`, the whole session): `pool.run(fn, *args)` runs the
module-level function `fn(group, *args)` on every rank at once and returns the ranks' results
in rank order. A rank that raises fails the call with its traceback; a call that does not
finish within its timeout, or a rank that dies, kills every process of the pool (the next call
starts a new one), so a failing test never hangs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ferrum.distributed.parallel_state import destroy_distributed, init_distributed

START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 180.0


def _serve(
    rank: int, world_size: int, init_method: str, backend: str, tasks: Any, results: Any
) -> None:
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        group = init_distributed(world_size, rank, init_method, backend)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    try:
        while True:
            task = tasks.get()
            if task is None:
                return
            fn, args = task
            try:
                results.put((rank, True, fn(group, *args)))
            except BaseException:
                results.put((rank, False, traceback.format_exc()))
    finally:
        destroy_distributed()


class RankPool:
    """`backend` "nccl": rank r runs on cuda:r (needs world_size GPUs)."""

    def __init__(self, world_size: int = 2, backend: str = "gloo") -> None:
        self.world_size = world_size
        self.backend = backend
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._tmpdir = tempfile.TemporaryDirectory(prefix="ferrum-tp-")
        init_method = "file://" + os.path.join(self._tmpdir.name, "rendezvous")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._processes = [
            ctx.Process(
                target=_serve,
                args=(
                    rank,
                    self.world_size,
                    init_method,
                    self.backend,
                    self._tasks[rank],
                    self._results,
                ),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for process in self._processes:
            process.start()
        self._collect(START_TIMEOUT_S, "start")

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: float = CALL_TIMEOUT_S,
    ) -> list[Any]:
        """fn(group, *args) on every rank; the results in rank order."""
        if not self._processes:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        return self._collect(timeout, fn.__name__)

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            while len(results) + len(errors) < self.world_size:
                try:
                    rank, ok, value = self._results.get(timeout=timeout)
                except queue.Empty:
                    dead = [p.exitcode for p in self._processes if not p.is_alive()]
                    raise AssertionError(
                        f"{what}: ranks did not answer within {timeout} s (exit codes of dead "
                        f"ranks: {dead}); {len(errors)} failed:\n" + "\n".join(errors)
                    ) from None
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
                    # The other ranks may wait in a collective for the failed one.
                    timeout = min(timeout, 10.0)
        except BaseException:
            self.close()
            raise
        if errors:
            self.close()
            raise AssertionError(f"{what} failed:\n" + "\n".join(errors))
        return [results[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        """Stops every rank (asks, then kills what is left) and forgets them."""
        for tasks in self._tasks:
            with contextlib.suppress(OSError, ValueError):
                tasks.put(None)
        for process in self._processes:
            process.join(timeout=5)
        for process in self._processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self._processes = []
        self._tasks = []
        if self._tmpdir is not None:
            self._tmpdir.cleanup()
            self._tmpdir = None
