"""`data_parallel_size` engine cores behind one client, each on its own devices. A request goes to
one replica (`ReplicaRouter`) with all its `n` completions and stays there, aborts and stop-string
finishes with it. Each replica restarts (or not) on its own while the others serve; one that dies
kills them all, so that a server exits non-zero, as with one core.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from ferrum.config import EngineConfig
from ferrum.engine.core_client import (
    ClientEvent,
    CoreClient,
    EngineDied,
    EventSink,
    FrontEndThread,
)
from ferrum.engine.core_messages import CoreInfo, CoreOutputs, EngineCoreRequest, SchedulerStats
from ferrum.engine.core_stats import sum_replica_stats
from ferrum.engine.dp_router import ReplicaRouter, replica_config, shared_ray_cluster
from ferrum.engine.process_client import ProcessClient
from ferrum.logger import init_logger
from ferrum.recovery_config import EngineRecoveryConfig
from ferrum.request import RequestStatus

logger = init_logger(__name__)


def core_processes(config: EngineConfig, recovery_config: EngineRecoveryConfig) -> CoreClient:
    """A client of core processes, each restarted after a crash as `recovery_config` says: one
    core, or one per data-parallel replica."""
    num_replicas = config.parallel_config.data_parallel_size
    if num_replicas == 1:
        return ProcessClient(config, recovery_config)
    replicas: list[CoreClient] = [
        ProcessClient(replica_config(config, i), recovery_config) for i in range(num_replicas)
    ]
    return DataParallelClient(config, replicas)


class DataParallelClient(CoreClient):
    def __init__(self, config: EngineConfig, replicas: list[CoreClient]) -> None:
        self.replicas = replicas
        self.router = ReplicaRouter(len(replicas), config.cache_config.block_size)
        self.dead_reason: str | None = None
        self._ray_cluster = shared_ray_cluster(config)
        self._infos: list[CoreInfo | None] = [None] * len(replicas)
        # Each open completion's replica and the id its request was routed by (its first
        # completion's); how many completions of each routed request are open.
        self._placement: dict[str, tuple[int, str]] = {}
        self._num_open: dict[str, int] = {}
        self._sink: EventSink | None = None

    @property
    def num_restarts(self) -> int:  # type: ignore[override]
        return sum(r.num_restarts for r in self.replicas)

    def start(self, sink: EventSink, thread: FrontEndThread) -> None:
        self._sink = sink
        for index, replica in enumerate(self.replicas):
            replica.start(functools.partial(self._on_replica_event, index), thread)

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def shutdown(self) -> None:
        """Stops every replica at once (bounded), then the shared Ray cluster."""
        self.close()
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(lambda replica: replica.shutdown(), self.replicas))
        if self._ray_cluster is not None:
            self._ray_cluster.release()
            self._ray_cluster = None

    def fail(self, reason: str) -> None:
        if self.dead_reason is None:
            self._die(reason)

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("%s; the data-parallel engine is dead", reason)
        assert self._sink is not None
        self._sink(EngineDied(reason))
        for replica in self.replicas:
            replica.fail(reason)

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

    def replica_stats(self) -> list[SchedulerStats | None]:
        return [r.stats() for r in self.replicas]

    def stats(self) -> SchedulerStats | None:
        """The replicas' stats added up (`sum_replica_stats`)."""
        num_blocks = [0 if info is None else info.num_kv_blocks for info in self._infos]
        return sum_replica_stats(self.replica_stats(), num_blocks)

    # -- requests ------------------------------------------------------------------------------

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        # Routed under its first completion's id (the request id when n == 1).
        key = requests[0].req_id
        serving = [r.health_problem() is None for r in self.replicas]
        usage = [s.kv_cache_usage if s is not None else 0.0 for s in self.replica_stats()]
        tokens = requests[0].prompt_token_ids
        replica = self.router.route(key, tokens, len(requests), serving, usage)
        self._num_open[key] = len(requests)
        for request in requests:
            self._placement[request.req_id] = (replica, key)
        self.replicas[replica].add_requests(requests)

    def finish_requests(self, req_ids: Sequence[str], status: RequestStatus) -> None:
        by_replica: dict[int, list[str]] = {}
        for req_id in req_ids:
            placement = self._placement.get(req_id)
            if placement is not None:
                by_replica.setdefault(placement[0], []).append(req_id)
        for replica, ids in by_replica.items():
            self.replicas[replica].finish_requests(ids, status)
            self._release(ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self._placement)

    def _release(self, req_ids: Sequence[str]) -> None:
        """Finished completions leave their replica; a request's last one frees its route."""
        for req_id in req_ids:
            placement = self._placement.pop(req_id, None)
            if placement is None:
                continue
            key = placement[1]
            self._num_open[key] -= 1
            if not self._num_open[key]:
                del self._num_open[key]
                self.router.release(key)

    # -- events --------------------------------------------------------------------------------

    def _on_replica_event(self, index: int, event: ClientEvent) -> None:
        if self.dead_reason is not None:
            return
        assert self._sink is not None
        match event:
            case CoreInfo():
                self._infos[index] = event
                if all(info is not None for info in self._infos):
                    self._sink(self._smallest_pool())
            case CoreOutputs(outputs, _):
                self._sink(event)
                self._release([o.req_id for o in outputs if o.finish_reason is not None])
            case EngineDied(reason):
                self._die(f"engine core replica {index}: {reason}")
            case _:
                self._sink(event)

    def _smallest_pool(self) -> CoreInfo:
        """The replicas as one engine: requests are checked against the smallest pool."""
        infos = [info for info in self._infos if info is not None]
        smallest = min(infos, key=lambda info: info.max_tokens_in_pool)
        pids = tuple(pid for info in infos for pid in info.worker_pids)
        num_blocks = sum(info.num_kv_blocks for info in infos)
        return dataclasses.replace(smallest, num_kv_blocks=num_blocks, worker_pids=pids)
