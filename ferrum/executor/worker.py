"""One tensor-parallel rank in its own process: joins the process group, builds its runner and
serves the core's messages (`messages.py`) in order until told to stop. Started by
`MultiprocExecutor` as `python -m ferrum.executor.worker` (never re-importing the user's main) with
`WorkerArgs` on stdin and three pipe ends: inbox, outbox and a lifeline the core never writes. When
the core ends the lifeline reads EOF and the worker exits, even while blocked in a collective."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from ferrum.config import EngineConfig
from ferrum.distributed.parallel_state import destroy_distributed
from ferrum.executor.bitmask_channel import BitmaskLayout, BitmaskReader
from ferrum.executor.messages import FromWorker, ShutdownWorker, WorkerFailed, WorkerReady
from ferrum.executor.rank import RankServer, start_rank

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
        runner = start_rank(
            config, device, args.rank, args.world_size, args.init_method, args.backend
        )
        reader = BitmaskReader(args.bitmask_fd, args.bitmask_layout)
        _send(outbox, WorkerReady(args.rank, runner.kernel_backend))
        _serve(RankServer(runner, args.rank, reader), inbox, outbox)
    except (EOFError, BrokenPipeError):
        os._exit(EXIT_CORE_GONE)  # the core is gone: nobody is left to tell
    except BaseException as e:
        error = "".join(traceback.format_exception(e)).rstrip()
        with contextlib.suppress(OSError):
            _send(outbox, WorkerFailed(args.rank, error))
        # Peers may wait for this rank in a collective: exit without tearing anything down.
        os._exit(1)
    destroy_distributed()


def _serve(server: RankServer, inbox: Connection, outbox: Connection) -> None:
    while True:
        message = pickle.loads(inbox.recv_bytes())
        if isinstance(message, ShutdownWorker):
            return
        reply = server.handle(message)
        if reply is not None:
            _send(outbox, reply)


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
