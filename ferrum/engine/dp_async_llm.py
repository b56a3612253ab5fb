"""The asyncio front end over `data_parallel_size` engine cores: `AsyncLLM`'s interface for the
API server, with one `AsyncLLM` per replica (its core process on its own devices,
`dp_router.replica_config`) sharing one tokenizer and one grammar compiler.

Each request goes to one replica (`ReplicaRouter`: least open completions, prefix affinity) with
all its `n` completions, and stays there until its stream closes; aborts go to that replica.
Failures follow the recovery policy per replica: a crashed core is restarted by its own
`AsyncLLM` and resumes its own requests while the other replicas keep serving (new requests go
to the serving ones). A replica that dies (policy "exit", a failed start, or its crash-loop
limit) kills the whole front end: every open stream fails and `wait_dead()` returns, so that the
server exits non-zero for a supervisor, as with one core.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ferrum.config import EngineConfig
from ferrum.engine.async_llm import AsyncLLM, EngineDeadError
from ferrum.engine.core_messages import CoreInfo, SchedulerStats
from ferrum.engine.core_stats import sum_replica_stats
from ferrum.engine.dp_router import ReplicaRouter, replica_config, shared_ray_cluster
from ferrum.engine.input_processor import InputProcessor, PromptType
from ferrum.engine.request_stream import RequestStream
from ferrum.logger import init_logger
from ferrum.outputs import RequestOutput
from ferrum.recovery_config import EngineRecoveryConfig
from ferrum.sampling_params import SamplingParams

logger = init_logger(__name__)


class DPAsyncLLM:
    def __init__(
        self, config: EngineConfig, recovery_config: EngineRecoveryConfig | None = None
    ) -> None:
        self.config = config
        self.recovery_config = recovery_config or EngineRecoveryConfig()
        num_replicas = config.parallel_config.data_parallel_size
        self._ray_cluster = shared_ray_cluster(config)
        first = AsyncLLM(replica_config(config, 0), self.recovery_config)
        self.replicas = [first] + [
            AsyncLLM(replica_config(config, i), self.recovery_config, share_with=first)
            for i in range(1, num_replicas)
        ]
        self.tokenizer = first.tokenizer
        self.grammars = first.grammars
        self.router = ReplicaRouter(num_replicas, config.cache_config.block_size)
        self.dead_reason: str | None = None
        self._dead = asyncio.Event()
        self._num_kv_blocks = [0] * num_replicas
        self._watchers: list[asyncio.Task[None]] = []

    # -- life cycle ----------------------------------------------------------------------------

    async def start(self) -> CoreInfo:
        """Starts every replica's core and waits until all are loaded; returns the info of the
        one with the smallest KV pool. Raises EngineDeadError if any fails to start."""
        loop = asyncio.get_running_loop()
        self._watchers = [
            loop.create_task(self._watch(i, replica)) for i, replica in enumerate(self.replicas)
        ]
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                self._die(f"engine core replica {i} failed to start: {result}")
                raise EngineDeadError(self.dead_reason)
        infos = [r for r in results if isinstance(r, CoreInfo)]
        self._num_kv_blocks = [info.num_kv_blocks for info in infos]
        logger.info("%d data-parallel engine cores ready", len(infos))
        return min(infos, key=lambda info: info.max_tokens_in_pool)

    async def _watch(self, index: int, replica: AsyncLLM) -> None:
        reason = await replica.wait_dead()
        self._die(f"engine core replica {index}: {reason}")

    def _die(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s; the data-parallel engine is dead", reason)
        for replica in self.replicas:
            replica.fail(reason)
        self._dead.set()

    @property
    def is_ready(self) -> bool:
        return self.dead_reason is None and all(r.is_ready for r in self.replicas)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def health_problem(self) -> tuple[str, str] | None:
        """None while at least one replica serves (the others may be restarting)."""
        if self.dead_reason is not None:
            return "engine_dead", f"the engine is dead: {self.dead_reason}"
        problems = [r.health_problem() for r in self.replicas]
        if any(p is not None and p[0] == "engine_loading" for p in problems):
            return "engine_loading", "the engine is still loading"
        if all(p is not None for p in problems):
            code = problems[0][0]  # type: ignore[index]
            reasons = "; ".join(f"replica {i}: {p[1]}" for i, p in enumerate(problems) if p)
            return code, reasons
        return None

    async def wait_dead(self) -> str:
        await self._dead.wait()
        assert self.dead_reason is not None
        return self.dead_reason

    async def shutdown(self) -> None:
        """Finishes every open stream as aborted, then stops every core process (bounded)."""
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*(r.shutdown() for r in self.replicas))
        if self._ray_cluster is not None:
            self._ray_cluster.release()

    # -- requests ------------------------------------------------------------------------------

    def check_can_serve(self) -> InputProcessor:
        """The input processor of the replica with the smallest KV pool (requests are checked
        against it); raises EngineDeadError or EngineNotReadyError if none can be served now."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        processors = [r.check_can_serve() for r in self.replicas]
        return min(processors, key=lambda p: p.pool_tokens)

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> RequestStream:
        """Validates the request and queues it on the replica the router picks; on error nothing
        is queued. Iterate the returned stream as `AsyncLLM.add_request`'s."""
        processed = self.check_can_serve().process_prompt(prompt)
        serving = [r.health_problem() is None for r in self.replicas]
        usage = [s.kv_cache_usage if s is not None else 0.0 for s in self.replica_stats()]
        index = self.router.route(request_id, processed.token_ids, params.n, serving, usage)
        try:
            stream = self.replicas[index].add_request(request_id, processed, params)
        except BaseException:
            self.router.release(request_id)
            raise
        stream.on_close = self.abort
        return stream

    async def compile_grammar(self, params: SamplingParams) -> None:
        await self.replicas[0].compile_grammar(params)

    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        async for output in self.add_request(request_id, prompt, params):
            yield output

    def abort(self, request_id: str) -> RequestOutput | None:
        """Aborts a request on its replica (unknown or closed ids: None) and forgets where it
        ran; a stream's end calls this too."""
        index = self.router.release(request_id)
        return None if index is None else self.replicas[index].abort(request_id)

    def abort_all(self) -> None:
        for replica in self.replicas:
            replica.abort_all()

    @property
    def num_open_requests(self) -> int:
        return sum(r.num_open_requests for r in self.replicas)

    @property
    def num_restarts(self) -> int:
        return sum(r.num_restarts for r in self.replicas)

    def replica_stats(self) -> list[SchedulerStats | None]:
        """Each replica's stats (`AsyncLLM.stats`), in replica order."""
        return [r.stats() for r in self.replicas]

    def stats(self) -> SchedulerStats | None:
        """The replicas' stats added up (`sum_replica_stats`)."""
        return sum_replica_stats(self.replica_stats(), self._num_kv_blocks)

    def add_finished_listener(self, listener: Callable[[RequestOutput], None]) -> None:
        for replica in self.replicas:
            replica.add_finished_listener(listener)


# What the API server drives: one core, or data-parallel replicas.
AsyncEngine = AsyncLLM | DPAsyncLLM


def build_async_engine(
    config: EngineConfig, recovery_config: EngineRecoveryConfig | None = None
) -> AsyncEngine:
    """One `AsyncLLM`, or a `DPAsyncLLM` over data_parallel_size of them."""
    if config.parallel_config.data_parallel_size > 1:
        return DPAsyncLLM(config, recovery_config)
    return AsyncLLM(config, recovery_config)
