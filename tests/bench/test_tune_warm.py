"""`ferrum tune`'s compile pool (tune_warm): the tuner hands each task's candidates to it before
timing them, the workers run every candidate once on their own bench, a failing candidate is
reported and the rest still run, and a dead worker closes the pool without stopping the run."""

from __future__ import annotations

import functools
import multiprocessing
import os

import pytest
import torch

from ferrum.bench import tune, tune_warm
from ferrum.bench.tune_gpu import GpuBench
from ferrum.bench.tune_ops import candidates
from ferrum.bench.tune_shapes import LinearShape, MoEShape, TuneTask, build_tasks
from ferrum.bench.tune_store import TuneStore
from ferrum.kernels.device_properties import H100, L40S
from ferrum.kernels.gemv_config import GemvTile


def _label(prefix: str) -> str:
    return prefix


def _describe(item) -> str | None:
    """A worker's work in these tests: what ran where (the initializer's bench is a string)."""
    task, config = item
    if config == "bad":
        return "refused"
    return f"{tune_warm._worker_bench}|{task.key}|{config}|{os.getpid()}"


def _die(item) -> str | None:
    os._exit(3)


def test_the_tuner_warms_each_task_it_times_before_timing_it(tmp_path) -> None:
    tasks = build_tasks(("gemv",), [LinearShape(256, 4096), LinearShape(512, 4096)], [], (1,))
    store = TuneStore(tmp_path, H100, fp8=False)
    store.record(tasks[0], None, 1.0, 1)  # measured before: neither warmed nor timed again
    events: list[tuple[str, str]] = []

    def warm(task: TuneTask, configs: list) -> list:
        assert configs == candidates(task, H100)
        events.append(("warm", task.key))
        return [None] * len(configs)

    def time_fn(task: TuneTask, config) -> float:
        events.append(("time", task.key))
        return 1.0

    tune.run_tuning(tasks, store, lambda t: candidates(t, H100), time_fn, False, warm)
    timed = [e for e in events if e[0] == "time"]
    assert events[0] == ("warm", tasks[1].key) and len(events) == 1 + len(timed)
    assert {key for _, key in timed} == {tasks[1].key}


def test_a_candidate_that_broke_a_workers_context_is_not_timed(tmp_path) -> None:
    """A CUDA error of the candidate's own in a worker (an illegal address) would break the
    timer's context too: it is counted as failed, not run; a worker's lack of memory is not the
    candidate's, so that one is still timed."""
    task = build_tasks(("gemv",), [LinearShape(256, 4096)], [], (1,))[0]
    configs = candidates(task, H100)[:4]
    failures = [
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered",
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        None,
    ]
    timed: list = []
    counts = tune.run_tuning(
        [task], TuneStore(tmp_path, H100, fp8=False), lambda t: configs,
        lambda t, c: timed.append(c) or 1.0, False, lambda t, c: failures,
    )  # fmt: skip
    assert timed == configs[2:] and counts["failed"] == 2 and counts["measured"] == 1


def test_workers_run_every_candidate_on_their_bench_and_report_failures() -> None:
    pool = tune_warm.CompilePool(2, _label, ("bench0",), work=_describe)
    try:
        task = TuneTask("gemv", LinearShape(64, 128), 1)
        got = pool.warm(task, ["a", "bad", "b", "c"])
        assert got[1] == "refused"
        ran = [g.split("|") for g in got if g != "refused"]
        assert [r[:3] for r in ran] == [["bench0", task.key, c] for c in ("a", "b", "c")]
        assert all(int(r[3]) != os.getpid() for r in ran)  # in the worker processes
    finally:
        pool.close()


def test_default_workers_fit_half_the_free_gpu_memory(monkeypatch) -> None:
    monkeypatch.setattr(tune_warm, "usable_cores", lambda: 16)  # the H200 host's
    gib = 1 << 30
    experts = MoEShape(128, 768, 2048, 8)  # Qwen3-30B-A3B's: 1.2 GB as bf16
    assert tune_warm.shape_bytes(experts) == 16 * 128 * 768 * 2048  # 3.2 GB making FP8 ones
    assert tune_warm.default_compile_workers([experts], 130 * gib) == 8
    # Half of 24 GiB over (1 GiB + 3.2 GB) a worker: 3.
    assert tune_warm.default_compile_workers([experts], 24 * gib) == 3
    assert tune_warm.default_compile_workers([LinearShape(4096, 4096)], 1 * gib) == 0
    monkeypatch.setattr(tune_warm, "usable_cores", lambda: 2)  # this machine, CI's
    assert tune_warm.default_compile_workers([experts], 130 * gib) == 1


def _hang(item) -> str | None:
    import time

    time.sleep(120)
    return None


def _cuda_error(item) -> str | None:
    return "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_a_hung_worker_is_ended_and_named() -> None:
    before = set(multiprocessing.active_children())
    pool = tune_warm.CompilePool(1, _label, ("x",), work=_hang, timeout_s=3.0)
    task = TuneTask("gemv", LinearShape(64, 128), 1)
    assert pool.warm(task, ["a"]) == [None]
    assert pool.executor is None and "took over 3 s" in pool.closed_because
    assert set(multiprocessing.active_children()) <= before  # ended, not left on the GPU


def test_a_cuda_error_in_a_worker_closes_the_pool() -> None:
    pool = tune_warm.CompilePool(1, _label, ("x",), work=_cuda_error)
    task = TuneTask("gemv", LinearShape(64, 128), 1)
    assert pool.warm(task, ["a"])[0].startswith("RuntimeError: CUDA error")
    assert pool.executor is None and "CUDA error" in pool.closed_because


def test_a_dead_worker_closes_the_pool_and_the_run_goes_on() -> None:
    pool = tune_warm.CompilePool(1, _label, ("x",), work=_die)
    task = TuneTask("gemv", LinearShape(64, 128), 1)
    assert pool.warm(task, ["a", "b"]) == [None, None]
    assert pool.executor is None and pool.closed_because == "a worker process died"
    assert pool.warm(task, ["c"]) == [None]  # closed: the timer's process compiles


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build of the calls")
def test_a_worker_runs_real_candidates_once_and_names_a_refused_one() -> None:
    """The worker's function itself, in this process on a CPU bench (the interpreter)."""
    make = functools.partial(GpuBench, max_copies=1, torch_device="cpu", dtype=torch.float16)
    tune_warm.start_bench(make, L40S, False)
    assert tune_warm._worker_bench._copies(1) == 1  # one weight copy: it only compiles
    task = TuneTask("gemv", LinearShape(48, 256), 1)
    assert tune_warm.warm_candidate((task, GemvTile(2, 128))) is None
    assert tune_warm.warm_candidate((task, None)) is None  # F.linear
    refused = tune_warm.warm_candidate((task, {"BLOCK_N": 3}))  # not a GEMV tile
    assert refused is not None and refused.startswith("AssertionError")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build of the calls")
def test_spawned_workers_run_real_candidates_end_to_end() -> None:
    """The pool as `ferrum tune` starts it (GpuBench in each worker, warm_candidate), here on
    CPU tensors under the interpreter the workers inherit: tiles, tasks and the device pickle
    across, a good tile runs and a wrong one is named."""
    make = functools.partial(GpuBench, max_copies=1, torch_device="cpu", dtype=torch.float16)
    pool = tune_warm.CompilePool(1, make, (L40S, False))
    try:
        task = TuneTask("gemv", LinearShape(48, 256), 1)
        assert pool.warm(task, [GemvTile(2, 128), None]) == [None, None]
        refused = pool.warm(task, [{"BLOCK_N": 3}])[0]
        assert refused is not None and refused.startswith("AssertionError")
    finally:
        pool.close()
