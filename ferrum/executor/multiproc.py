"""Tensor parallelism over one worker process per rank (`worker.py`), all on this host. Every call
is pickled once and written to each worker's pipe; set-up calls wait for every rank, `complete`
for rank 0's tokens (every rank samples the same). The core fills the constrained bitmask rows and
sends them with the step (or in `sample` while the forward runs). A worker that exits, raises or
stays silent `worker_step_timeout` seconds fails the call (WorkerDiedError / WorkerStepError);
every worker is then killed (survivors may wait in a collective) and later calls raise."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from ferrum import envs
from ferrum.config import EngineConfig
from ferrum.executor.abstract import WorkerDiedError, WorkerStepError
from ferrum.executor.bitmask_channel import BitmaskLayout, BitmaskWriter
from ferrum.executor.messages import (
    CompleteStep,
    FromWorker,
    GrammarBitmaskRows,
    LaunchStep,
    NumKVBlocks,
    ShutdownWorker,
    StepOutput,
    ToWorker,
    WorkerDone,
    WorkerFailed,
    WorkerReady,
)
from ferrum.executor.multi_rank import LaunchedRankStep, MultiRankExecutor
from ferrum.executor.worker import WorkerArgs
from ferrum.logger import init_logger
from ferrum.scheduler.output import ModelRunnerOutput
from ferrum.speculative_config import max_sampled_rows
from ferrum.structured_output import StructuredOutputMatcher
from ferrum.structured_output.draft_rows import draft_row_starts

logger = init_logger(__name__)

# Seconds the workers get to exit after ShutdownWorker before they are killed.
SHUTDOWN_TIMEOUT = 10.0
# Bytes a step may queue in a worker's pipe before the core's write waits for the worker.
_PIPE_BYTES = 1 << 20
_PROTOCOL = pickle.HIGHEST_PROTOCOL


@dataclass(slots=True)
class _Worker:
    rank: int
    process: subprocess.Popen[bytes]
    inbox: Connection  # the core writes
    outbox: Connection  # the core reads
    # Never written: the worker exits when its read end sees this end closed.
    lifeline_fd: int


class MultiprocExecutor(MultiRankExecutor):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        world_size = config.parallel_config.world_size
        device = torch.device(config.device_config.device)
        last = (device.index or 0) + world_size - 1
        if device.type == "cuda" and torch.cuda.device_count() <= last:
            raise ValueError(
                f"{world_size} ranks (tensor x pipeline parallel) from {device} need cuda:{last}; "
                f"{torch.cuda.device_count()} CUDA device(s) visible"
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._workers: list[_Worker] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        # Why the workers were lost (every call raises it), or None.
        self._failure: RuntimeError | None = None
        self._shut_down = False
        # Kills the workers if this executor is dropped (or the interpreter exits) unstopped.
        self._finalizer = weakref.finalize(self, _kill, self._processes)
        self._complete_message = pickle.dumps(CompleteStep(), protocol=_PROTOCOL)
        # Sparse until a constrained step touches it.
        max_rows = max_sampled_rows(config.scheduler_config.max_num_seqs, config.speculative_config)
        self._bitmask = BitmaskWriter(BitmaskLayout(max_rows, config.model_config.vocab_size))
        self._bitmask_filler: Any = None
        try:
            for rank in range(world_size):
                self._workers.append(self._start_worker(rank, init_method, backend))
            ready = self._call_all(None)
        except BaseException:
            self.shutdown()
            raise
        assert all(isinstance(r, WorkerReady) for r in ready)
        self.kernel_backend = ready[0].kernel_backend
        logger.info(
            "%d model-parallel workers ready (%s): pids %s",
            world_size,
            backend,
            self.worker_pids,
        )

    def _start_worker(self, rank: int, init_method: str, backend: str) -> _Worker:
        inbox_r, inbox_w = os.pipe()
        outbox_r, outbox_w = os.pipe()
        lifeline_r, lifeline_w = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(inbox_w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
        env = envs.child_environment()
        # The worker imports the same ferrum as this process.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        args = WorkerArgs(
            self.config,
            rank,
            self.config.parallel_config.world_size,
            init_method,
            backend,
            inbox_fd=inbox_r,
            outbox_fd=outbox_w,
            lifeline_fd=lifeline_r,
            bitmask_fd=self._bitmask.fd,
            bitmask_layout=self._bitmask.layout,
        )
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "ferrum.executor.worker"],
                stdin=subprocess.PIPE,
                pass_fds=(inbox_r, outbox_w, lifeline_r, self._bitmask.fd),
                env=env,
            )
        except BaseException:
            for fd in (inbox_r, inbox_w, outbox_r, outbox_w, lifeline_r, lifeline_w):
                os.close(fd)
            raise
        self._processes.append(process)
        # Only the worker holds these ends now: its death reads as end-of-file here.
        for fd in (inbox_r, outbox_w, lifeline_r):
            os.close(fd)
        assert process.stdin is not None
        with process.stdin:
            process.stdin.write(pickle.dumps(args, protocol=_PROTOCOL))
        return _Worker(
            rank,
            process,
            Connection(inbox_w, readable=False),
            Connection(outbox_r, writable=False),
            lifeline_w,
        )

    # -- set-up ----------------------------------------------------------------------------------

    def _call_all(self, message: ToWorker | None) -> list[FromWorker]:
        """Sends `message` (None: nothing, wait for WorkerReady) and returns every rank's
        reply, rank order."""
        if message is not None:
            self._broadcast(pickle.dumps(message, protocol=_PROTOCOL))
        replies: dict[int, FromWorker] = {}
        while len(replies) < len(self._workers):
            pending = {w.outbox: w for w in self._workers if w.rank not in replies}
            for conn in wait(list(pending)):
                worker = pending[conn]  # type: ignore[index]
                reply = self._receive(worker)
                if not isinstance(reply, (WorkerReady, NumKVBlocks, WorkerDone)):
                    raise self._fail(WorkerStepError(f"worker {worker.rank}: unexpected {reply}"))
                replies[worker.rank] = reply
        return [replies[rank] for rank in range(len(self._workers))]

    # -- steps -----------------------------------------------------------------------------------

    def _send_launch(self, message: LaunchStep) -> None:
        self._send(message)

    def _send(self, message: ToWorker) -> None:
        self._broadcast(pickle.dumps(message, protocol=_PROTOCOL))

    def complete(self, launched: LaunchedRankStep) -> ModelRunnerOutput:
        self._broadcast(self._complete_message)
        first = self._workers[self.config.parallel_config.output_rank]
        conns = {w.outbox: w for w in self._workers}
        timeout = self.config.parallel_config.worker_step_timeout
        deadline = time.monotonic() + timeout
        while True:
            ready = wait(list(conns), timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                raise self._fail(
                    WorkerStepError(
                        f"no step result from the tensor-parallel workers within "
                        f"worker_step_timeout={timeout:g} s: a worker hangs"
                    )
                )
            if first.outbox in ready:
                reply = self._receive(first)
                if isinstance(reply, StepOutput):
                    return reply.output
                raise self._fail(WorkerStepError(f"worker {first.rank}: unexpected {reply}"))
            for conn in ready:
                self._receive_failure(conns[conn])  # type: ignore[index]

    def _fill_bitmask(
        self, matchers: dict[str, StructuredOutputMatcher], drafts: dict[str, list[int]]
    ) -> GrammarBitmaskRows:
        from ferrum.structured_output import BatchBitmaskFiller

        if self._bitmask_filler is None:
            self._bitmask_filler = BatchBitmaskFiller()
        req_ids = list(matchers)
        starts, num_rows = draft_row_starts(req_ids, drafts)
        slot, rows = self._bitmask.begin(num_rows)
        self._bitmask_filler.fill_with_drafts(
            rows, [(i, matchers[r], drafts.get(r, [])) for i, r in zip(starts, req_ids)]
        )
        self._bitmask.publish(slot)
        return GrammarBitmaskRows(req_ids, slot)

    # -- health and failures ---------------------------------------------------------------------

    def check_health(self) -> None:
        if self._failure is not None:
            raise self._failure
        conns = {w.outbox: w for w in self._workers}
        for conn in wait(list(conns), timeout=0):
            self._receive_failure(conns[conn])  # type: ignore[index]

    @property
    def failure_sentinels(self) -> list[Any]:
        return [w.outbox for w in self._workers]

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def _broadcast(self, data: bytes) -> None:
        if self._failure is not None:
            raise self._failure
        for worker in self._workers:
            try:
                worker.inbox.send_bytes(data)
            except OSError:
                raise self._fail(self._died(worker)) from None

    def _receive(self, worker: _Worker) -> FromWorker:
        """The worker's next message; raises (after killing every worker) if it exited or
        failed."""
        try:
            reply = pickle.loads(worker.outbox.recv_bytes())
        except (EOFError, OSError):
            raise self._fail(self._died(worker)) from None
        if isinstance(reply, WorkerFailed):
            raise self._fail(
                WorkerStepError(f"tensor-parallel worker {reply.rank} failed: {reply.error}")
            )
        return reply

    def _receive_failure(self, worker: _Worker) -> None:
        """Reads a message that can only be a failure: outside a step, or from a rank other
        than the output rank."""
        reply = self._receive(worker)
        raise self._fail(WorkerStepError(f"worker {worker.rank}: unexpected {reply}"))

    def _died(self, worker: _Worker) -> WorkerDiedError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.process.wait(1.0)
        code = worker.process.returncode
        how = "is gone" if code is None else f"exited with code {code}"
        if code is not None and code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        return WorkerDiedError(
            f"tensor-parallel worker {worker.rank} (pid {worker.process.pid}) {how}"
        )

    def _fail(self, error: RuntimeError) -> RuntimeError:
        """Records the first failure and kills every worker; returns the error to raise."""
        if self._failure is None:
            self._failure = error
            logger.error("%s; killing the tensor-parallel workers", error)
            _kill(self._processes)
        return self._failure

    def shutdown(self) -> None:
        if self._shut_down:
            return
        self._shut_down = True
        if self._failure is None:
            with contextlib.suppress(OSError, RuntimeError):
                self._broadcast(pickle.dumps(ShutdownWorker(), protocol=_PROTOCOL))
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(deadline - time.monotonic(), 0.0))
        _kill(self._processes)
        for worker in self._workers:
            worker.inbox.close()
            worker.outbox.close()
            with contextlib.suppress(OSError):
                os.close(worker.lifeline_fd)
        self._bitmask.close()
        self._finalizer.detach()


def _kill(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILLs (a stopped process too) and reaps every process still running; bounded."""
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(OSError):
                process.kill()
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(5.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
