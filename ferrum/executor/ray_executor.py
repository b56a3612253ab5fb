"""Tensor parallelism over Ray actors (`ray_worker.py`), one per rank, packed on one node by a
placement group; the cluster is the connected one, else `ray.init()`'s, else a local one. Steps
reach every rank through one compiled Ray graph (`bench_executor_broadcast.py`: far cheaper than
actor calls); `launch` holds its step back for the next message (the core completes or samples
right after), so one execution per step. Bitmask rows travel in the message (ranks may be remote).
Failures: a thread per actor waits on `wait_for_failure`, then kills every actor (others may wait
in a collective, which only a kill ends), so the graph read raises and `complete` raises the
recorded WorkerStepError / WorkerDiedError; a hung rank hits `worker_step_timeout`."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import torch

from ferrum.config import EngineConfig
from ferrum.executor.abstract import WorkerDiedError, WorkerStepError
from ferrum.executor.messages import (
    CompleteStep,
    FromWorker,
    InlineBitmaskRows,
    LaunchStep,
    StepOutput,
    ToWorker,
    WorkerReady,
)
from ferrum.executor.multi_rank import LaunchedRankStep, MultiRankExecutor
from ferrum.executor.ray_cluster import connect, import_ray, kill, release, reserve
from ferrum.executor.ray_worker import MONITOR_GROUP, RayWorker
from ferrum.logger import init_logger
from ferrum.model_executor.token_bitmask import allocate_token_bitmask
from ferrum.scheduler.output import ModelRunnerOutput
from ferrum.speculative_config import max_sampled_rows
from ferrum.structured_output import StructuredOutputMatcher
from ferrum.structured_output.draft_rows import draft_row_starts

logger = init_logger(__name__)

# Seconds a failed graph read waits for the monitor to name the failure.
_FAILURE_REPORT_TIMEOUT = 10.0
# A CPU rank's share of a Ray CPU: Ray only places CPU ranks (their threads are
# `num_cpu_threads`), so that a small test cluster holds several engines.
CPU_RANK_SHARE = 0.25
# An infinite wait for a compiled graph's submit or read.
_NO_TIMEOUT = -1


class RayExecutor(MultiRankExecutor):
    def __init__(self, config: EngineConfig) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        world_size = config.parallel_config.world_size
        on_cuda = torch.device(config.device_config.device).type == "cuda"
        self._connected_here = connect(ray)
        self._actors: list[Any] = []
        # One per pipeline stage: a stage's tensor-parallel ranks share a node, the stages may
        # not (rank r is bundle r % tp of group r // tp).
        self._placement_groups: list[Any] = []
        self._dag: Any = None
        self._lock = threading.Lock()
        # Why the workers were lost (every call raises it), or None; set once, under the lock.
        self._failure: RuntimeError | None = None
        self._failed = threading.Event()
        self._shut_down = False
        # Readable once a failure is recorded: the engine core's idle wait wakes on it.
        read_fd, self._sentinel_fd = os.pipe()
        self._sentinel = Connection(read_fd, writable=False)
        # Launches not sent yet: they go with the next message, one graph execution (the core
        # completes or samples right after each launch).
        self._pending: list[ToWorker] = []
        # The graph outputs of the executions sent and not read yet, oldest first.
        self._unread: deque[list[Any]] = deque()
        self._bitmask_host: torch.Tensor | None = None
        self._bitmask_filler: Any = None
        self._finalizer = weakref.finalize(self, release, ray, self._actors, self._placement_groups)
        tp = config.parallel_config.tensor_parallel_size
        try:
            bundle = {"GPU": 1.0} if on_cuda else {"CPU": CPU_RANK_SHARE}
            for _ in range(config.parallel_config.pipeline_parallel_size):
                self._placement_groups.append(reserve(ray, [bundle] * tp))
            remote_worker = ray.remote(concurrency_groups={MONITOR_GROUP: 1})(RayWorker)
            for rank in range(world_size):
                strategy = PlacementGroupSchedulingStrategy(
                    self._placement_groups[rank // tp], placement_group_bundle_index=rank % tp
                )
                actor = remote_worker.options(
                    num_cpus=0 if on_cuda else CPU_RANK_SHARE,
                    num_gpus=1 if on_cuda else 0,
                    scheduling_strategy=strategy,
                    max_restarts=0,
                ).remote(config, rank)
                self._actors.append(actor)
            monitors = [
                a.wait_for_failure.options(concurrency_group=MONITOR_GROUP).remote()
                for a in self._actors
            ]
            threading.Thread(
                target=self._watch, args=(ray, monitors), name="ferrum-ray-monitor", daemon=True
            ).start()
            ready = self._start_ranks(ray, on_cuda)
            self._dag = self._compile()
        except BaseException:
            self.shutdown()
            raise
        self.kernel_backend = ready[0].kernel_backend
        logger.info(
            "%d model-parallel Ray workers ready (%s), rank 0 on node %s",
            world_size,
            "nccl" if on_cuda else "gloo",
            self._node_ip,
        )

    def _start_ranks(self, ray: Any, on_cuda: bool) -> list[WorkerReady]:
        placements = self._get_all(ray, [a.placement.remote() for a in self._actors])
        init_method = self._get_all(ray, [self._actors[0].rendezvous_address.remote()])[0]
        self._node_ip = init_method.removeprefix("tcp://").rpartition(":")[0]
        calls = []
        for actor, (node_id, gpu_ids) in zip(self._actors, placements):
            visible, index = None, 0
            if on_cuda:
                # Every rank of a node sees the node's GPUs of the group, in one order.
                node_gpus = sorted(
                    {g for n, ids in placements if n == node_id for g in ids}, key=int
                )
                visible, index = ",".join(node_gpus), node_gpus.index(gpu_ids[0])
            backend = "nccl" if on_cuda else "gloo"
            calls.append(
                actor.start.remote(visible, index, len(self._actors), init_method, backend)
            )
        return self._get_all(ray, calls)

    def _compile(self) -> Any:
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as messages:
            outputs = [actor.execute.bind(messages) for actor in self._actors]
        return MultiOutputNode(outputs).experimental_compile(_submit_timeout=_NO_TIMEOUT)

    def _get_all(self, ray: Any, refs: list[Any]) -> list[Any]:
        """The results of plain actor calls, in order; raises the recorded failure as soon as
        one call fails (the others may wait for the failed rank forever)."""
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=1)
            if self._failed.is_set():
                raise self._failure_after(None)
        try:
            return ray.get(refs)
        except Exception as e:
            raise self._failure_after(e) from None

    # -- set-up ----------------------------------------------------------------------------------

    def _call_all(self, message: ToWorker) -> list[FromWorker | None]:
        self._submit(message)
        return self._read_all(None)

    # -- steps -----------------------------------------------------------------------------------

    def _send_launch(self, message: LaunchStep) -> None:
        # It travels with the next message: one graph execution (the core completes or
        # samples right after each launch).
        if self._failure is not None:
            raise self._failure
        self._pending.append(message)

    def _send(self, message: ToWorker) -> None:
        self._submit(message)

    def complete(self, launched: LaunchedRankStep) -> ModelRunnerOutput:
        self._submit(CompleteStep())
        parallel = self.config.parallel_config
        replies = self._read_all(time.monotonic() + parallel.worker_step_timeout)
        reply = replies[parallel.output_rank]
        if isinstance(reply, StepOutput):
            return reply.output
        raise self._fail(WorkerStepError(f"worker {parallel.output_rank}: unexpected {reply!r}"))

    def _fill_bitmask(
        self, matchers: dict[str, StructuredOutputMatcher], drafts: dict[str, list[int]]
    ) -> InlineBitmaskRows:
        from ferrum.structured_output import BatchBitmaskFiller

        config = self.config
        if self._bitmask_host is None:
            max_rows = max_sampled_rows(
                config.scheduler_config.max_num_seqs, config.speculative_config
            )
            self._bitmask_host = allocate_token_bitmask(max_rows, config.model_config.vocab_size)
            self._bitmask_filler = BatchBitmaskFiller()
        req_ids = list(matchers)
        starts, num_rows = draft_row_starts(req_ids, drafts)
        rows = self._bitmask_host[:num_rows]
        self._bitmask_filler.fill_with_drafts(
            rows, [(i, matchers[r], drafts.get(r, [])) for i, r in zip(starts, req_ids)]
        )
        return InlineBitmaskRows(req_ids, rows.clone())

    def _submit(self, message: ToWorker) -> None:
        """Sends the launches held back and `message` as one graph execution."""
        if self._failure is not None:
            raise self._failure
        messages, self._pending = [*self._pending, message], []
        try:
            self._unread.append(self._dag.execute(messages))
        except Exception as e:
            raise self._failure_after(e) from None

    def _read_all(self, deadline: float | None) -> list[FromWorker | None]:
        """Reads every execution sent so far; returns the last one's replies, rank order.
        Waits without limit when `deadline` (a `time.monotonic()` value) is None."""
        ray = import_ray()
        replies: list[FromWorker | None] = []
        try:
            while self._unread:
                refs = self._unread[0]
                if deadline is None:
                    replies = [ref.get(timeout=_NO_TIMEOUT) for ref in refs]
                else:
                    replies = [
                        ref.get(timeout=max(deadline - time.monotonic(), 1e-3)) for ref in refs
                    ]
                self._unread.popleft()
            return replies
        except ray.exceptions.RayChannelTimeoutError:
            if not self._failed.is_set():
                timeout = self.config.parallel_config.worker_step_timeout
                raise self._fail(
                    WorkerStepError(
                        f"no step result from the tensor-parallel Ray workers within "
                        f"worker_step_timeout={timeout:g} s: a worker hangs"
                    )
                ) from None
            raise self._failure_after(None) from None
        except Exception as e:
            raise self._failure_after(e) from None

    # -- health and failures ---------------------------------------------------------------------

    def check_health(self) -> None:
        if self._failure is not None:
            raise self._failure

    @property
    def failure_sentinels(self) -> list[Any]:
        return [self._sentinel]

    @property
    def worker_pids(self) -> list[int]:
        """None: Ray owns the actors' processes (maybe on other hosts) and ends them with
        this process, their owner."""
        return []

    def _watch(self, ray: Any, monitors: list[Any]) -> None:
        """Waits for the first actor to fail (or die), then fails the executor."""
        try:
            ready, _ = ray.wait(monitors, num_returns=1)
        except Exception:  # Ray itself shut down
            ready = []
        if self._shut_down:
            return
        if not ready:
            self._fail(WorkerDiedError("the Ray cluster went away"))
            return
        rank = monitors.index(ready[0])
        try:
            error: RuntimeError = WorkerStepError(
                f"tensor-parallel worker {rank} failed: {ray.get(ready[0])}"
            )
        except Exception as e:
            cause = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            error = WorkerDiedError(f"tensor-parallel worker {rank} (Ray actor) died: {cause}")
        if not self._shut_down:
            self._fail(error)

    def _failure_after(self, error: Exception | None) -> RuntimeError:
        """The recorded failure once the monitor names it (a graph read raised because an actor
        failed); the read's own error if the monitor says nothing."""
        if self._failed.wait(_FAILURE_REPORT_TIMEOUT) and self._failure is not None:
            return self._failure
        return self._fail(WorkerDiedError(f"the Ray workers failed: {error!r}"))

    def _fail(self, error: RuntimeError) -> RuntimeError:
        """Records the first failure and kills every actor; returns the error to raise."""
        with self._lock:
            if self._failure is None:
                self._failure = error
                logger.error("%s; killing the tensor-parallel Ray workers", error)
                kill(import_ray(), self._actors)
                with contextlib.suppress(OSError):
                    os.write(self._sentinel_fd, b"x")
                self._failed.set()
            return self._failure

    def shutdown(self) -> None:
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        ray = import_ray()
        dag, self._dag = self._dag, None
        if dag is not None and self._failure is None:
            with contextlib.suppress(Exception):
                dag.teardown()  # ends the actors' graph loops; quick while they are idle
        release(ray, self._actors, self._placement_groups)
        if dag is not None and self._failure is not None:
            with contextlib.suppress(Exception):
                dag.teardown()
        self._finalizer.detach()
        self._sentinel.close()
        with contextlib.suppress(OSError):
            os.close(self._sentinel_fd)
        if self._connected_here:
            ray.shutdown()
