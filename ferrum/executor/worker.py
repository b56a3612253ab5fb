"""One tensor-parallel rank in its own process: joins the process group, builds its model runner
(its shard of the model) and serves the core's messages (`messages.py`) in order until told to
stop.

Started by `MultiprocExecutor` as `python -m ferrum.executor.worker` (never a re-import of the
user's main module), with its `WorkerArgs` pickled on stdin and three inherited pipe ends: the
inbox (core -> worker), the outbox (worker -> core) and a lifeline the core never writes to. When
the core process ends, for any reason, the lifeline reads end-of-file and the worker exits at
once, even while its main thread waits in a collective for a peer that is gone.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from ferrum.config import EngineConfig
from ferrum.distributed.parallel_state import destroy_distributed, init_distributed
from ferrum.executor.bitmask_channel import BitmaskLayout, BitmaskReader
from ferrum.executor.messages import (
    CaptureCudaGraphs,
    CompleteStep,
    DetermineNumKVBlocks,
    FromWorker,
    GrammarBitmaskRows,
    InitializeKVCache,
    LaunchStep,
    NumKVBlocks,
    SampleStep,
    ShutdownWorker,
    StepOutput,
    WarmUp,
    WorkerDone,
    WorkerFailed,
    WorkerReady,
)
from ferrum.executor.step_profiler import StepProfiler
from ferrum.model_executor.model_runner import LaunchedStep, ModelRunner
from ferrum.structured_output import FilledBitmaskRow

# Exit status of a worker whose core process is gone.
EXIT_CORE_GONE = 3


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    config: EngineConfig
    rank: int
    world_size: int
    # torch.distributed rendezvous, e.g. "tcp://127.0.0.1:PORT", and "nccl" or "gloo".
    init_method: str
    backend: str
    inbox_fd: int
    outbox_fd: int
    lifeline_fd: int
    # The core's shared bitmask rows (bitmask_channel.py).
    bitmask_fd: int
    bitmask_layout: BitmaskLayout


def worker_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r runs on the r-th CUDA device from the configured one (cuda:0 unless told), or on
    the CPU."""
    device = torch.device(config.device_config.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def main() -> None:
    args: WorkerArgs = pickle.load(sys.stdin.buffer)
    sys.stdin.close()
    run_worker(args)


def run_worker(args: WorkerArgs) -> None:
    # Ctrl-C reaches the whole process group; the core decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_lifeline(args.lifeline_fd)
    inbox = Connection(args.inbox_fd, writable=False)
    outbox = Connection(args.outbox_fd, readable=False)
    config = args.config
    try:
        device = worker_device(config, args.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if config.device_config.num_cpu_threads is not None:
            torch.set_num_threads(config.device_config.num_cpu_threads)
        group = init_distributed(
            args.world_size,
            args.rank,
            args.init_method,
            args.backend,
            custom_all_reduce=not config.parallel_config.disable_custom_all_reduce,
        )
        runner = ModelRunner(config, device, group)
        bitmask = BitmaskReader(args.bitmask_fd, args.bitmask_layout)
        _send(outbox, WorkerReady(args.rank, runner.kernel_backend))
        _serve(runner, args.rank, inbox, outbox, bitmask)
    except (EOFError, BrokenPipeError):
        os._exit(EXIT_CORE_GONE)  # the core is gone: nobody is left to tell
    except BaseException as e:
        error = "".join(traceback.format_exception(e)).rstrip()
        with contextlib.suppress(OSError):
            _send(outbox, WorkerFailed(args.rank, error))
        # Peers may wait for this rank in a collective: exit without tearing anything down.
        os._exit(1)
    destroy_distributed()


def _serve(
    runner: ModelRunner,
    rank: int,
    inbox: Connection,
    outbox: Connection,
    bitmask_reader: BitmaskReader,
) -> None:
    in_flight: deque[LaunchedStep] = deque()
    # Rows still to come for the latest step, launched with deferred sampling.
    deferred_rows: list[FilledBitmaskRow] = []
    profiler = StepProfiler(rank)
    while True:
        message = pickle.loads(inbox.recv_bytes())
        match message:
            case LaunchStep(scheduler_output, bitmask, None):
                matchers = _filled_rows(bitmask_reader, bitmask) if bitmask else None
                in_flight.append(runner.launch(scheduler_output, matchers))
            case LaunchStep(scheduler_output, _, deferred_req_ids):
                deferred_rows = [
                    FilledBitmaskRow(_NO_ROWS, i) for i in range(len(deferred_req_ids))
                ]
                matchers = dict(zip(deferred_req_ids, deferred_rows))
                in_flight.append(runner.launch(scheduler_output, matchers, defer_sampling=True))
            case SampleStep(bitmask):
                rows = bitmask_reader.read(bitmask.slot)
                for row in deferred_rows:
                    row.rows = rows
                step = in_flight[-1]
                if step.awaits_sampling:  # else no constrained row sampled: it is sampled
                    runner.sample(step)
            case CompleteStep():
                profiler.before_step()
                output = runner.complete(in_flight.popleft())
                profiler.after_step()
                if rank == 0:
                    _send(outbox, StepOutput(output))
            case DetermineNumKVBlocks():
                _send(outbox, NumKVBlocks(rank, runner.determine_num_kv_blocks()))
            case InitializeKVCache(num_blocks):
                runner.initialize_kv_cache(num_blocks)
                _send(outbox, WorkerDone(rank))
            case WarmUp(num_blocks):
                runner.warm_up(num_blocks)
                _send(outbox, WorkerDone(rank))
            case CaptureCudaGraphs():
                runner.capture_cuda_graphs()
                _send(outbox, WorkerDone(rank))
            case ShutdownWorker():
                return
            case _:
                raise TypeError(f"worker: unknown message {message!r}")


def _filled_rows(reader: BitmaskReader, bitmask: GrammarBitmaskRows) -> dict[str, FilledBitmaskRow]:
    rows = reader.read(bitmask.slot)
    return {req_id: FilledBitmaskRow(rows, i) for i, req_id in enumerate(bitmask.req_ids)}


# Stands in for the rows of a deferred step until its SampleStep brings them.
_NO_ROWS = torch.empty(0, 0, dtype=torch.int32)


def _send(outbox: Connection, message: FromWorker) -> None:
    outbox.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _watch_lifeline(fd: int) -> None:
    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1):
                pass
        os._exit(EXIT_CORE_GONE)

    threading.Thread(target=watch, name="ferrum-worker-lifeline", daemon=True).start()


if __name__ == "__main__":
    main()
