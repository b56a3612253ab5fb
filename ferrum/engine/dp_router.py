"""Which replica of a data-parallel front end gets a request: each open request belongs to one
replica, all `n` completions, from `route` to `release`; a replica's load is its open completions,
counted here exactly (a core's stats lag the pipe). The least loaded wins (ties: lower KV usage,
then least recently chosen), unless the prompt's first KV block matches a recent one: it follows
that one (its blocks may be cached) within `PREFIX_AFFINITY_SLACK` completions of the least load."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ferrum.config import EngineConfig

if TYPE_CHECKING:
    from ferrum.executor.ray_cluster import SharedRayCluster

# How many more open completions than the least loaded replica a replica may have and still
# get a request whose first prompt block it saw recently.
PREFIX_AFFINITY_SLACK = 4
# First-block keys remembered (least recently routed dropped first).
MAX_PREFIX_ENTRIES = 4096


class ReplicaRouter:
    def __init__(self, num_replicas: int, block_size: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas: must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self._loads = [0] * num_replicas
        # request id -> (replica, number of completions).
        self._assigned: dict[str, tuple[int, int]] = {}
        # first prompt block -> the replica that last got a prompt starting with it.
        self._prefix_owner: OrderedDict[tuple[int, ...], int] = OrderedDict()
        # When each replica was last chosen (a counter), for round-robin among equals.
        self._last_chosen = list(range(-num_replicas, 0))
        self._num_routed = 0

    def route(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        num_completions: int,
        serving: Sequence[bool],
        kv_cache_usage: Sequence[float] | None = None,
    ) -> int:
        """Assigns the request to a replica and returns it. `serving[i]`: replica i can take
        requests now; when none can, every replica is a candidate (the request waits there).
        `kv_cache_usage[i]`: replica i's latest usage (0 when unknown)."""
        if request_id in self._assigned:
            raise ValueError(f"request_id: {request_id!r} is already open")
        candidates = [i for i in range(self.num_replicas) if serving[i]]
        candidates = candidates or list(range(self.num_replicas))
        usage = kv_cache_usage or [0.0] * self.num_replicas
        least = min(candidates, key=lambda i: (self._loads[i], usage[i], self._last_chosen[i]))
        replica = least
        key = self._prefix_key(prompt_token_ids)
        if key is not None:
            owner = self._prefix_owner.get(key)
            if (
                owner is not None
                and owner in candidates
                and self._loads[owner] <= self._loads[least] + PREFIX_AFFINITY_SLACK
            ):
                replica = owner
            self._prefix_owner[key] = replica
            self._prefix_owner.move_to_end(key)
            if len(self._prefix_owner) > MAX_PREFIX_ENTRIES:
                self._prefix_owner.popitem(last=False)
        self._assigned[request_id] = (replica, num_completions)
        self._loads[replica] += num_completions
        self._last_chosen[replica] = self._num_routed
        self._num_routed += 1
        return replica

    def replica_of(self, request_id: str) -> int | None:
        assigned = self._assigned.get(request_id)
        return None if assigned is None else assigned[0]

    def release(self, request_id: str) -> int | None:
        """The request finished or was aborted: its load leaves its replica, which is returned
        (None for an unknown or already released id)."""
        assigned = self._assigned.pop(request_id, None)
        if assigned is None:
            return None
        replica, num_completions = assigned
        self._loads[replica] -= num_completions
        return replica

    def load(self, replica: int) -> int:
        return self._loads[replica]

    @property
    def num_open_requests(self) -> int:
        return len(self._assigned)

    def _prefix_key(self, prompt_token_ids: Sequence[int]) -> tuple[int, ...] | None:
        # The prefix cache never serves a prompt's last token: one full block must precede it.
        if len(prompt_token_ids) <= self.block_size:
            return None
        return tuple(prompt_token_ids[: self.block_size])


def shared_ray_cluster(config: EngineConfig) -> SharedRayCluster | None:
    """With the Ray backend, the one cluster every replica's core joins (held by the front end
    until its cores stop); None otherwise."""
    if config.parallel_config.distributed_executor_backend != "ray":
        return None
    from ferrum.executor.ray_cluster import SharedRayCluster

    return SharedRayCluster()


def replica_config(config: EngineConfig, replica: int) -> EngineConfig:
    """The config of replica `replica`'s core: on CUDA its own devices (cuda:i * world_size
    onward from the configured index); on the CPU, and with Ray (which gives each replica's
    ranks their GPUs), the same config."""
    device = config.device_config.device
    ray = config.parallel_config.distributed_executor_backend == "ray"
    if not device.startswith("cuda") or replica == 0 or ray:
        return config
    base = int(device.partition(":")[2] or "0")
    first = base + replica * config.parallel_config.world_size
    device_config = dataclasses.replace(config.device_config, device=f"cuda:{first}")
    return dataclasses.replace(config, device_config=device_config)
