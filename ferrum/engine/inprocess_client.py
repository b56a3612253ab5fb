"""The engine core in the front end's own thread: the synchronous `LLMEngine`'s client, where each
`poll` is one engine step. A core failure raises from `poll`; nothing is restarted."""

from __future__ import annotations

from collections.abc import Sequence

from ferrum.config import EngineConfig
from ferrum.engine.core import EngineCore
from ferrum.engine.core_client import CoreClient, EventSink, FrontEndThread
from ferrum.engine.core_messages import CoreInfo, CoreOutputs, EngineCoreRequest, SchedulerStats
from ferrum.request import RequestStatus
from ferrum.structured_output.manager import StructuredOutputManager


class InProcessClient(CoreClient):
    def __init__(self, config: EngineConfig, grammars: StructuredOutputManager) -> None:
        """`grammars`: the front end's manager, shared with the core (one compile each)."""
        self.config = config
        self._grammars = grammars
        self._sink: EventSink | None = None
        self.core: EngineCore | None = None

    def start(self, sink: EventSink, thread: FrontEndThread) -> None:
        self._sink = sink
        core = self.core = EngineCore(self.config, grammars=self._grammars)
        kv = core.kv_cache_manager
        sink(CoreInfo(kv.num_usable_blocks, kv.max_tokens_in_pool(), 0.0, core.startup_seconds))

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        assert self.core is not None
        for request in requests:
            self.core.add_request(request)

    def finish_requests(self, req_ids: Sequence[str], status: RequestStatus) -> None:
        if self.core is not None:
            self.core.finish_requests(list(req_ids), status)

    def poll(self, thread: FrontEndThread) -> None:
        assert self.core is not None and self._sink is not None
        self._sink(CoreOutputs(self.core.step(), None))

    def has_unfinished_requests(self) -> bool:
        return self.core is not None and self.core.has_unfinished_requests()

    def health_problem(self) -> tuple[str, str] | None:
        return None

    def stats(self) -> SchedulerStats | None:
        return None if self.core is None else self.core.stats()

    def fail(self, reason: str) -> None:
        """Nothing to tell: the core runs in this thread, its failures raise to the caller."""

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.shutdown()
