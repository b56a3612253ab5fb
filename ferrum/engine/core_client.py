"""What a front end holds of its engine core(s): the core in this thread, a core process (restarted
or not) or data-parallel replicas of them, behind one interface (`make_core_client` picks).
Requests go in by `add_requests` / `finish_requests`; events come out through the sink given to
`start`, always on the front end's thread (its event loop, or inside `poll`), in this order:
`CoreInfo` (loaded, again after each restart), `CoreOutputs` (a step's tokens, minus what a restart
must hide), `RequestsFailed` (those alone), `EngineDied` (last: the engine serves no more)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ferrum.engine.core_messages import CoreInfo, CoreOutputs, EngineCoreRequest, SchedulerStats
from ferrum.request import RequestStatus


@dataclass(frozen=True, slots=True)
class RequestsFailed:
    """These completions (core request ids) failed alone with `error`."""

    req_ids: list[str]
    error: BaseException


@dataclass(frozen=True, slots=True)
class EngineDied:
    reason: str


ClientEvent = CoreInfo | CoreOutputs | RequestsFailed | EngineDied
EventSink = Callable[[ClientEvent], None]


class FrontEndThread:
    """Runs callbacks from a client's background threads on the front end's thread: on its event
    loop (`loop`), or queued until the front end runs them (`run_pending`, synchronous)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self._pending: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )

    def call_soon(self, callback: Callable[..., None], *args: Any) -> None:
        """Thread-safe. After the loop closed, nobody is listening: the callback is dropped."""
        loop = self.loop
        if loop is None:
            self._pending.put((callback, args))
        elif not loop.is_closed():
            # RuntimeError: the loop closed since the check.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(callback, *args)

    def run_pending(self) -> None:
        """Synchronous front ends: waits for one callback, then runs it and every one queued."""
        assert self.loop is None, "an event loop runs its own callbacks"
        callbacks = [self._pending.get()]
        with contextlib.suppress(queue.Empty):
            while True:
                callbacks.append(self._pending.get_nowait())
        for callback, args in callbacks:
            callback(*args)


class CoreClient(ABC):
    # Core restarts so far (summed over replicas).
    num_restarts: int = 0

    @abstractmethod
    def start(self, sink: EventSink, thread: FrontEndThread) -> None:
        """Starts the core(s); returns at once (`CoreInfo` follows when they are loaded), except
        in process, where the core is built before it returns."""

    @abstractmethod
    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        """Queues one request's completions (all of them, together)."""

    @abstractmethod
    def finish_requests(self, req_ids: Sequence[str], status: RequestStatus) -> None:
        """Aborts, or stops on a stop string; unknown or finished ids are ignored."""

    def poll(self, thread: FrontEndThread) -> None:
        """Synchronous front ends, while requests are open: delivers the next events (the cores
        step on their own; the in-process client runs a step here)."""
        thread.run_pending()

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Completions sent and not yet finished (or outputs not yet delivered)."""

    @abstractmethod
    def health_problem(self) -> tuple[str, str] | None:
        """(code, message) of why no request can be served now, or None."""

    @abstractmethod
    def stats(self) -> SchedulerStats | None:
        """Counters over every core so far, gauges of the serving ones; None before a step."""

    def replica_stats(self) -> list[SchedulerStats | None]:
        """Each data-parallel replica's stats (one entry without data parallelism)."""
        return [self.stats()]

    @abstractmethod
    def fail(self, reason: str) -> None:
        """Declares the engine dead for `reason`: an `EngineDied` follows (unless it did)."""

    def close(self) -> None:  # noqa: B027 - most clients have nothing to stop early
        """On the front end's thread: no event, restart or watchdog from now on (then
        `shutdown`, which may run on another thread)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the core(s), bounded (stragglers are killed); safe to call twice."""
