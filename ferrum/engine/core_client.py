"""Runs an EngineCore in its own process and talks to it over two pipes.

Layout: the front end (API server) owns an `EngineCoreClient`; `start()` spawns a process that
builds the `EngineCore` and runs `_busy_loop`. Each direction has its own one-way pipe carrying
pickled lists of messages:

- front end -> core: ("add", [Request, ...]), ("abort", [req_id, ...]) (blocks return to the pool
  at once), ("stop", [req_id, ...]) (a stop string matched), ("shutdown", None).
- core -> front end: ("ready", CoreInfo), ("outputs", ([EngineCoreOutput, ...], SchedulerStats))
  after every step and after control messages that changed state, ("rejected", [(req_id, reason)]),
  ("failed", reason) just before the core process exits on an error.

The core never waits on HTTP, tokenization or detokenization: it drains its inbox without blocking
between steps, and blocks only when it has no work. The client side uses two daemon threads (one
sending, one receiving) and hands every received message to a callback, so the caller's event loop
never blocks on a pipe either.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ferrum import envs
from ferrum.config import EngineConfig
from ferrum.engine.request import Request, RequestStatus
from ferrum.logger import init_logger

logger = init_logger(__name__)

Message = tuple[str, Any]


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the front end needs from a started core."""

    num_kv_blocks: int
    max_tokens_in_pool: int
    # Seconds spent in the core process before it was ready: imports, then EngineCore(...).
    import_seconds: float
    engine_seconds: float


class EngineCoreClient:
    """The front end's handle on a core process.

    `on_message(kind, payload)` is called from a background thread for every message from the
    core; when the core dies without saying why, it gets ("failed", reason) once.
    """

    def __init__(self, config: EngineConfig, on_message: Callable[[str, Any], None]) -> None:
        self.config = config
        self._on_message = on_message
        self._outbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._closed = False

    def start(self) -> None:
        """Spawns the core process; returns at once (the core reports "ready" when loaded)."""
        ctx = multiprocessing.get_context("spawn")
        to_core_recv, to_core_send = ctx.Pipe(duplex=False)
        from_core_recv, from_core_send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=run_engine_core,
            args=(self.config, to_core_recv, from_core_send, envs.debug_fail_forward()),
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

    def add_requests(self, requests: list[Request]) -> None:
        self._outbox.put(("add", requests))

    def abort_requests(self, req_ids: list[str]) -> None:
        if req_ids:
            self._outbox.put(("abort", req_ids))

    def stop_requests(self, req_ids: list[str]) -> None:
        if req_ids:
            self._outbox.put(("stop", req_ids))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Asks the core to exit, then terminates it if it has not within `timeout` seconds."""
        if self._closed:
            return
        self._closed = True
        self._outbox.put(("shutdown", None))
        self._outbox.put(None)
        process = self._process
        if process is None:
            return
        process.join(timeout)
        if process.is_alive():
            logger.warning("engine core did not exit in %.0f s; terminating it", timeout)
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)

    def _send_loop(self, conn: Connection) -> None:
        try:
            while True:
                batch = [self._outbox.get()]
                while True:
                    try:
                        batch.append(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                messages = [m for m in batch if m is not None]
                if messages:
                    conn.send(messages)
                if len(messages) < len(batch):
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
                for kind, payload in conn.recv():
                    self._on_message(kind, payload)
                    if kind == "failed":
                        return
        except (OSError, EOFError):
            pass
        finally:
            conn.close()
        if not self._closed:
            process = self._process
            if process is not None:
                process.join(1.0)
                if process.exitcode is not None:
                    reason += f" (exit code {process.exitcode})"
            self._on_message("failed", reason)


def run_engine_core(
    config: EngineConfig,
    inbox: Connection,
    outbox: Connection,
    fail_forward_at: int | None,
) -> None:
    """The core process's entry point."""
    started = time.perf_counter()
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from ferrum.engine.core import EngineCore

        imported = time.perf_counter()
        core = EngineCore(config)
        if fail_forward_at is not None:
            _inject_forward_fault(core, fail_forward_at)
        info = CoreInfo(
            num_kv_blocks=core.kv_cache_manager.num_usable_blocks,
            max_tokens_in_pool=core.kv_cache_manager.max_tokens_in_pool(),
            import_seconds=imported - started,
            engine_seconds=time.perf_counter() - imported,
        )
        outbox.send([("ready", info)])
        _busy_loop(core, inbox, outbox)
    except (EOFError, BrokenPipeError):
        # The front end is gone: nobody is left to tell.
        return
    except BaseException as e:
        logger.error("engine core failed: %s", "".join(traceback.format_exception(e)).rstrip())
        with contextlib.suppress(OSError):
            outbox.send([("failed", f"engine core failed: {type(e).__name__}: {e}")])
        raise SystemExit(1) from None


def _busy_loop(core: Any, inbox: Connection, outbox: Connection) -> None:
    while True:
        messages: list[Message] = []
        if not core.has_unfinished_requests():
            messages.extend(inbox.recv())
        while inbox.poll():
            messages.extend(inbox.recv())
        replies: list[Message] = []
        for kind, payload in messages:
            if kind == "shutdown":
                return
            if kind == "add":
                rejected = []
                for request in payload:
                    try:
                        core.add_request(request)
                    except ValueError as e:
                        rejected.append((request.req_id, str(e)))
                if rejected:
                    replies.append(("rejected", rejected))
            elif kind == "abort":
                core.finish_requests(payload, RequestStatus.FINISHED_ABORTED)
            elif kind == "stop":
                core.finish_requests(payload, RequestStatus.FINISHED_STOPPED)
            else:
                raise ValueError(f"engine core: unknown message kind {kind!r}")
        if core.has_unfinished_requests():
            replies.append(("outputs", (core.step(), core.stats())))
        elif messages:
            replies.append(("outputs", ([], core.stats())))
        if replies:
            outbox.send(replies)


def _inject_forward_fault(core: Any, fail_at: int) -> None:
    """Makes the runner's `fail_at`-th non-empty step launch raise (FERRUM_DEBUG_FAIL_FORWARD)."""
    runner = core.runner
    launch = runner.launch
    count = 0

    def failing_launch(scheduler_output: Any) -> Any:
        nonlocal count
        if not scheduler_output.is_empty:
            count += 1
            if count == fail_at:
                raise RuntimeError(
                    f"injected fault in forward {fail_at} (FERRUM_DEBUG_FAIL_FORWARD)"
                )
        return launch(scheduler_output)

    runner.launch = failing_launch
    logger.warning("FERRUM_DEBUG_FAIL_FORWARD=%d: forward %d will raise", fail_at, fail_at)
