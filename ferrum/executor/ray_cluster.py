"""Ray cluster plumbing for the Ray executor: importing Ray (an optional extra), joining or
starting a cluster, reserving placement groups (one per pipeline stage, each on one node), and
releasing actors and groups."""

from __future__ import annotations

import contextlib
from typing import Any

from ferrum import envs
from ferrum.logger import init_logger

logger = init_logger(__name__)

# Seconds the placement group may wait for its resources before start-up fails.
PLACEMENT_TIMEOUT = 120.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: pip install 'ferrum[ray]'"
        ) from None
    return ray


def connect(ray: Any) -> bool:
    """Connects this process to a Ray cluster unless it is connected already; True if it
    connected here (then `ray.shutdown` at the end disconnects, and stops a local instance
    that `ray.init` started). `ray.init()` joins RAY_ADDRESS or the latest `ray start` cluster
    of this host, else starts a local instance (never another program's private one)."""
    if ray.is_initialized():
        return False
    ray.init(include_dashboard=False)
    return True


class SharedRayCluster:
    """The cluster every data-parallel replica's engine core joins: the front end connects to it
    (or starts a local instance, as `connect` does) and, until `release`, puts its address in
    RAY_ADDRESS, where Ray's `ray.init()` in each core process it starts looks (spawned
    processes inherit the environment). Without it every core would start its own local
    instance, each counting the node's GPUs as its own."""

    def __init__(self) -> None:
        ray = import_ray()
        self._connected_here = connect(ray)
        self.address: str = ray.get_runtime_context().gcs_address
        self._previous = envs.ray_address()
        envs.set_variable("RAY_ADDRESS", self.address)
        logger.info("data-parallel replicas join the Ray cluster at %s", self.address)

    def release(self) -> None:
        """Restores RAY_ADDRESS and disconnects (stopping a local instance started here); safe
        to call twice. Call it after the replicas' cores have stopped."""
        envs.set_variable("RAY_ADDRESS", self._previous)
        if self._connected_here:
            self._connected_here = False
            import_ray().shutdown()


def reserve(ray: Any, bundles: list[dict[str, float]]) -> Any:
    """A placement group with `bundles` on one node (STRICT_PACK), ready."""
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy="STRICT_PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT)
    if not ready:
        remove_placement_group(group)
        raise ValueError(
            f"tensor_parallel_size={len(bundles)}: no node of the Ray cluster could hold "
            f"{len(bundles)} x {bundles[0]} within {PLACEMENT_TIMEOUT:g} s (a tensor-parallel "
            f"group runs on one node); free now: {ray.available_resources()}"
        )
    return group


def kill(ray: Any, actors: list[Any]) -> None:
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)


def release(ray: Any, actors: list[Any], placement_groups: list[Any]) -> None:
    """Kills every actor and removes the placement groups (both no-ops once done)."""
    kill(ray, actors)
    if placement_groups:
        from ray.util.placement_group import remove_placement_group

        for group in placement_groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
