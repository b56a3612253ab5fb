"""The synchronous front end over `data_parallel_size` engine cores, each in its own process
(on its own devices, `dp_router.replica_config`): `LLMEngine`'s interface for the offline `LLM`.

One input and one output processor; the router picks each request's replica and keeps it there
with all its completions, so aborts and stop-string finishes reach the core that holds it. A
core failure is not recovered offline (as with `LLMEngine`, whose in-process core raises): the
next `step` raises `EngineDeadError` naming the replica, and so does every call after it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import weakref
from typing import TYPE_CHECKING

from ferrum.config import EngineConfig
from ferrum.engine.core_client import EngineCoreClient
from ferrum.engine.core_messages import (
    CoreFailed,
    CoreInfo,
    CoreOutputs,
    EngineCoreOutput,
    FromCore,
    SchedulerStats,
)
from ferrum.engine.core_stats import sum_replica_stats
from ferrum.engine.dp_router import ReplicaRouter, replica_config, shared_ray_cluster
from ferrum.engine.grammar_frontend import tokenizer_info_builder
from ferrum.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from ferrum.engine.output_processor import OutputProcessor
from ferrum.logger import init_logger
from ferrum.outputs import RequestOutput
from ferrum.request import RequestStatus
from ferrum.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferrum.executor.ray_cluster import SharedRayCluster
    from ferrum.structured_output.manager import StructuredOutputManager

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """An engine core of a data-parallel offline engine failed; the engine serves no more."""


class DataParallelLLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from ferrum.structured_output.manager import StructuredOutputManager

        self.config = config
        num_replicas = config.parallel_config.data_parallel_size
        self.tokenizer = load_tokenizer(config.model_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.router = ReplicaRouter(num_replicas, config.cache_config.block_size)
        tokenizer = self.tokenizer  # not `self`: the finalizer below holds the manager
        self.grammars = StructuredOutputManager(
            config.structured_outputs_config,
            tokenizer_info_builder(config.model_config, lambda: tokenizer),
        )
        self.dead_reason: str | None = None
        self._request_counter = itertools.count()
        # (replica, message) from every core's receiving thread, in arrival order.
        self._inbox: queue.SimpleQueue[tuple[int, FromCore]] = queue.SimpleQueue()
        self._ray_cluster = shared_ray_cluster(config)
        self._clients = [
            EngineCoreClient(replica_config(config, i), functools.partial(_put, self._inbox, i))
            for i in range(num_replicas)
        ]
        self._stats: list[SchedulerStats | None] = [None] * num_replicas
        self._num_kv_blocks = [0] * num_replicas
        # The core processes stop when this engine is collected or the interpreter exits.
        self._finalizer = weakref.finalize(
            self, _shutdown_all, self._clients, self.grammars, self._ray_cluster
        )
        for client in self._clients:
            client.start()
        try:
            infos = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.input_processor = InputProcessor(
            config.model_config, self.tokenizer, min(i.max_tokens_in_pool for i in infos)
        )

    def _wait_ready(self) -> list[CoreInfo]:
        infos: dict[int, CoreInfo] = {}
        while len(infos) < len(self._clients):
            replica, message = self._inbox.get()
            match message:
                case CoreInfo():
                    infos[replica] = message
                    self._num_kv_blocks[replica] = message.num_kv_blocks
                case CoreFailed(reason):
                    raise EngineDeadError(f"engine core {replica} failed to start: {reason}")
        logger.info(
            "%d engine cores ready: %s KV blocks",
            len(infos),
            " + ".join(str(infos[i].num_kv_blocks) for i in sorted(infos)),
        )
        return [infos[i] for i in sorted(infos)]

    def shutdown(self) -> None:
        """Stops every core process (bounded); the engine serves no more."""
        self.dead_reason = self.dead_reason or "the engine was shut down"
        self._finalizer()

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def start_grammar_compile(self, params: SamplingParams) -> None:
        """Starts compiling `params`' grammar (if any) here without waiting, to check it."""
        if params.structured_outputs is not None and self.tokenizer is not None:
            with contextlib.suppress(ValueError):
                self.grammars.submit(params.structured_outputs)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validates one request (n completions) and sends it to the least loaded replica; on
        error nothing is queued. A bad grammar is a ValueError here (each core compiles it
        again for itself)."""
        self._check_alive()
        prompt, requests = self.input_processor.process(request_id, prompt, params, arrival_time)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)
        self.output_processor.add_request(request_id, prompt, requests)
        serving = [True] * len(self._clients)
        usage = [s.kv_cache_usage if s is not None else 0.0 for s in self._stats]
        replica = self.router.route(request_id, prompt.token_ids, len(requests), serving, usage)
        self._clients[replica].add_requests(requests)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Aborts requests (unknown ids are ignored); each replica frees their KV blocks as soon
        as it reads the message."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            replica = self.router.release(request_id)
            if replica is not None:
                child_ids = self.output_processor.child_ids(request_id)
                self._clients[replica].finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.router.num_open_requests > 0

    def replica_stats(self) -> list[SchedulerStats | None]:
        """Each replica's stats as of its latest message read by `step` (None before any)."""
        return list(self._stats)

    def stats(self) -> SchedulerStats:
        return sum_replica_stats(self._stats, self._num_kv_blocks) or SchedulerStats(
            0, 0, 0.0, 0, 0, 0
        )

    def step(self) -> list[RequestOutput]:
        """Waits for the next messages of any core (none when no request is open) and returns
        the outputs of the requests that advanced (as their SamplingParams.output_kind asks)."""
        self._check_alive()
        if not self.has_unfinished_requests():
            return []
        messages = [self._inbox.get()]
        with contextlib.suppress(queue.Empty):
            while True:
                messages.append(self._inbox.get_nowait())
        outputs: list[RequestOutput] = []
        for replica, message in messages:
            match message:
                case CoreOutputs(core_outputs, stats):
                    self._stats[replica] = stats
                    outputs.extend(self._process(replica, core_outputs))
                case CoreFailed(reason):
                    self.dead_reason = f"engine core {replica} failed: {reason}"
                    self.shutdown()
                    self._check_alive()
        return outputs

    def _process(self, replica: int, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(core_outputs)
        self._clients[replica].finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for output in outputs:
            if output.finished:
                self.router.release(output.request_id)
        return outputs

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)


def _put(inbox: queue.SimpleQueue[tuple[int, FromCore]], replica: int, message: FromCore) -> None:
    inbox.put((replica, message))


def _shutdown_all(
    clients: list[EngineCoreClient],
    grammars: StructuredOutputManager,
    ray_cluster: SharedRayCluster | None,
) -> None:
    for client in clients:
        client.shutdown()
    grammars.shutdown()
    if ray_cluster is not None:
        ray_cluster.release()
