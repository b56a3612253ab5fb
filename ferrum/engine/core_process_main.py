"""The engine core process's main: builds the `EngineCore`, reports `CoreInfo`, then steps while
it has work and blocks on its inbox when it has none (`core_process.py` is the other side)."""

from __future__ import annotations

import contextlib
import signal
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from ferrum.config import EngineConfig
from ferrum.engine.core_messages import (
    CoreFailed,
    CoreInfo,
    CoreOutputs,
    EngineCoreRequest,
    FinishRequests,
    Shutdown,
    ToCore,
)
from ferrum.logger import init_logger

if TYPE_CHECKING:
    from ferrum.engine.core import EngineCore

logger = init_logger(__name__)


def run_engine_core(
    config: EngineConfig, inbox: Connection, outbox: Connection, core_index: int = 0
) -> None:
    """The core process's entry point (the engine's modules are imported here, and timed)."""
    started = time.perf_counter()
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    core = None
    try:
        from ferrum.engine.core import EngineCore
        from ferrum.executor import WorkerDiedError

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


def _busy_loop(core: EngineCore, inbox: Connection, outbox: Connection) -> None:
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
                    # Validated by the front end against this core's limits.
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
