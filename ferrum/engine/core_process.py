"""One engine core in its own process (`core_process_main.py`, never imported here: it pulls in
torch) and the two one-way pipes, carrying pickled lists of `core_messages.py`, and two daemon
threads (send, receive) that talk to it, so neither the core nor the caller's thread ever blocks
on a pipe, HTTP or text.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ferrum.config import EngineConfig
from ferrum.engine.core_messages import (
    CoreFailed,
    CoreInfo,
    EngineCoreRequest,
    FinishRequests,
    FromCore,
    Shutdown,
    ToCore,
)
from ferrum.logger import init_logger
from ferrum.request import RequestStatus

logger = init_logger(__name__)


class CoreProcess:
    """One core process: `on_message(message)` is called on a background thread for every
    message from the core; when the core dies without saying why, it gets one `CoreFailed`
    (unless `shutdown` or `kill` came first). A restart takes a new `CoreProcess`."""

    def __init__(
        self,
        config: EngineConfig,
        on_message: Callable[[FromCore], None],
        core_index: int = 0,
    ) -> None:
        """`core_index`: 0 for the front end's first core, n for its nth restart."""
        self.config = config
        self.core_index = core_index
        self._on_message = on_message
        self._outbox: queue.SimpleQueue[ToCore] = queue.SimpleQueue()
        self._process: multiprocessing.process.BaseProcess | None = None
        # The core's worker processes, once its CoreInfo names them: killed with the core.
        self._worker_pids: tuple[int, ...] = ()
        self._closed = False

    def start(self) -> None:
        """Spawns the core process; returns at once (the core sends `CoreInfo` when loaded)."""
        ctx = multiprocessing.get_context("spawn")
        to_core_recv, to_core_send = ctx.Pipe(duplex=False)
        from_core_recv, from_core_send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_core_process_main,
            args=(self.config, to_core_recv, from_core_send, self.core_index),
            name="ferrum-engine-core",
            daemon=True,
        )
        self._process.start()
        # Only the core holds these ends now, so a dead core reads as EOF here.
        to_core_recv.close()
        from_core_send.close()
        threading.Thread(
            target=self._send_loop, args=(to_core_send,), name="ferrum-core-send", daemon=True
        ).start()
        threading.Thread(
            target=self._recv_loop, args=(from_core_recv,), name="ferrum-core-recv", daemon=True
        ).start()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def pids(self) -> tuple[int, ...]:
        """The core process and its workers (once its CoreInfo named them)."""
        return () if self.pid is None else (self.pid, *self._worker_pids)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self._outbox.put(request)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        if req_ids:
            self._outbox.put(FinishRequests(req_ids, status))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Asks the core to exit, then terminates it if it has not within `timeout` seconds."""
        if self._closed:
            return
        self._closed = True
        self._outbox.put(Shutdown())
        process = self._process
        if process is None:
            return
        process.join(timeout)
        if process.is_alive():
            logger.warning("engine core did not exit in %.0f s; terminating it", timeout)
            self._kill_workers()
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)

    def kill(self) -> None:
        """Ends the core process now (SIGKILL: a stopped process too) and stops the client's
        threads, without blocking; no `CoreFailed` follows. A thread reaps the process."""
        self._closed = True
        self._outbox.put(Shutdown())  # wakes the sending thread, which then exits
        process = self._process
        if process is None:
            return
        if process.is_alive():
            # A killed core cannot stop its workers, which may be stuck (or stopped)
            # themselves; while the core lives, their pids cannot have been reused.
            self._kill_workers()
            process.kill()
        threading.Thread(target=process.join, name="ferrum-core-reap", daemon=True).start()

    def _kill_workers(self) -> None:
        """SIGKILLs the core's workers (the core, their parent, must still be alive, so that
        the pids are still theirs); the core or, once it is gone, init reaps them."""
        for pid in self._worker_pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def _send_loop(self, conn: Connection) -> None:
        try:
            while True:
                messages = [self._outbox.get()]
                with contextlib.suppress(queue.Empty):
                    while True:
                        messages.append(self._outbox.get_nowait())
                conn.send(messages)
                if any(isinstance(m, Shutdown) for m in messages):
                    return
        except (OSError, EOFError):
            # The core is gone; the receiving thread reports it.
            return
        finally:
            conn.close()

    def _recv_loop(self, conn: Connection) -> None:
        reason = "the engine core process exited unexpectedly"
        try:
            while True:
                for message in conn.recv():
                    if isinstance(message, CoreInfo):
                        self._worker_pids = message.worker_pids
                    self._on_message(message)
                    if isinstance(message, CoreFailed):
                        return
        except (OSError, EOFError):
            pass
        except Exception as e:  # e.g. a message cut short by the core's death
            reason += f" ({type(e).__name__} reading its messages)"
        finally:
            conn.close()
        if not self._closed:
            process = self._process
            if process is not None:
                process.join(1.0)
                if process.exitcode is not None:
                    reason += f" (exit code {process.exitcode})"
            self._on_message(CoreFailed(reason))


def _core_process_main(*args: Any) -> None:
    """The spawned process's target: the core's modules are imported there, never here."""
    from ferrum.engine.core_process_main import run_engine_core

    run_engine_core(*args)
