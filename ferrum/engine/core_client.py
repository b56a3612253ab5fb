"""Runs an EngineCore in its own process and talks to it over two pipes.

Layout: the front end (API server) owns an `EngineCoreClient`; `start()` spawns a process that
builds the `EngineCore` and runs `_busy_loop`. Each direction has its own one-way pipe carrying
pickled lists of the messages in `core_messages.py`.

The core never waits on HTTP, tokenization or detokenization: it drains its inbox without blocking
between steps, and blocks only when it has no work. The client side uses two daemon threads (one
sending, one receiving) and hands every received message to a callback, so the caller's event loop
never blocks on a pipe either.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from ferrum.config import EngineConfig
from ferrum.engine.core_messages import (
    CoreFailed,
    CoreInfo,
    CoreOutputs,
    EngineCoreRequest,
    FinishRequests,
    FromCore,
    Shutdown,
    ToCore,
)
from ferrum.executor import WorkerDiedError
from ferrum.logger import init_logger
from ferrum.request import RequestStatus

logger = init_logger(__name__)


class EngineCoreClient:
    """The front end's handle on a core process.

    `on_message(message)` is called from a background thread for every message from the core;
    when the core dies without saying why, it gets a `CoreFailed` once (unless the client was
    shut down or killed first). One client runs one core process: a restart takes a new client.
    """

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
            target=run_engine_core,
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


def run_engine_core(
    config: EngineConfig, inbox: Connection, outbox: Connection, core_index: int = 0
) -> None:
    """The core process's entry point."""
    started = time.perf_counter()
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    core = None
    try:
        from ferrum.engine.core import EngineCore

        imported = time.perf_counter()
        core = EngineCore(config, core_index)
        info = CoreInfo(
            num_kv_blocks=core.kv_cache_manager.num_usable_blocks,
            max_tokens_in_pool=core.kv_cache_manager.max_tokens_in_pool(),
            import_seconds=imported - started,
            engine_seconds=time.perf_counter() - imported,
            worker_pids=tuple(core.executor.worker_pids),
        )
        outbox.send([info])
        _busy_loop(core, inbox, outbox)
    except (EOFError, BrokenPipeError):
        # The front end is gone: nobody is left to tell.
        return
    except BaseException as e:
        logger.error("engine core failed: %s", "".join(traceback.format_exception(e)).rstrip())
        req_ids = None
        # A lost worker process blames nobody, like a lost core process.
        if core is not None and not isinstance(e, WorkerDiedError):
            req_ids = core.failed_step_req_ids or None
        failed = CoreFailed(f"engine core failed: {type(e).__name__}: {e}", req_ids)
        if core is not None:
            # Before the front end hears (it then kills this process): what the executor
            # started stops cleanly (a local Ray instance killed with its owner leaves agents).
            core, failed_core = None, core
            try:
                failed_core.shutdown()
            except Exception as shutdown_error:
                logger.error("stopping the failed core's workers: %r", shutdown_error)
        with contextlib.suppress(OSError):
            outbox.send([failed])
        raise SystemExit(1) from None
    finally:
        if core is not None:
            core.shutdown()


def _busy_loop(core: Any, inbox: Connection, outbox: Connection) -> None:
    while True:
        messages: list[ToCore] = []
        if not core.has_unfinished_requests():
            # Idle: wake for a message, or for a worker's failure (check_health raises).
            wait([inbox, *core.executor.failure_sentinels])
            core.check_health()
        while inbox.poll():
            messages.extend(inbox.recv())
        for message in messages:
            match message:
                case EngineCoreRequest():
                    # The front end checked it against the same limits: a refusal is a bug.
                    core.add_request(message)
                case FinishRequests(req_ids, status):
                    core.finish_requests(req_ids, status)
                case Shutdown():
                    return
                case _:
                    raise TypeError(f"engine core: unknown message {message!r}")
        if core.has_unfinished_requests():
            outbox.send([CoreOutputs(core.step(), core.stats())])
        elif messages:
            outbox.send([CoreOutputs([], core.stats())])
