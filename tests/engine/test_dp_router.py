"""Routing of a data-parallel front end: least open completions, ties by KV usage then round
robin, first-block prefix affinity within a slack, n completions on one replica, release; the
per-replica config (devices); replica stats added up."""

from __future__ import annotations

import dataclasses

import pytest

from ferrum.engine.core_messages import SchedulerStats
from ferrum.engine.core_stats import sum_replica_stats
from ferrum.engine.dp_router import PREFIX_AFFINITY_SLACK, ReplicaRouter, replica_config

ALL = [True, True, True]


def short(i: int) -> list[int]:
    """A prompt of one block (no prefix key): routed by load alone."""
    return [i, i, i, i]


def test_least_loaded_then_round_robin_among_equals() -> None:
    router = ReplicaRouter(3, block_size=4)
    assert [router.route(f"r{i}", short(i), 1, ALL) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    router.release("r1")
    router.release("r4")
    # Replica 1 holds nothing now; then ties go to the one chosen longest ago.
    assert router.route("a", short(7), 1, ALL) == 1
    assert router.route("b", short(8), 1, ALL) == 1
    assert router.route("c", short(9), 1, ALL) == 0


def test_n_completions_count_on_one_replica_and_release_returns_it() -> None:
    router = ReplicaRouter(2, block_size=4)
    assert router.route("fan", short(1), 4, [True, True]) == 0
    assert [router.route(f"r{i}", short(i), 1, [True, True]) for i in range(4)] == [1, 1, 1, 1]
    assert (router.load(0), router.load(1)) == (4, 4)
    assert router.replica_of("fan") == 0
    assert router.release("fan") == 0 and router.load(0) == 0
    assert router.release("fan") is None and router.replica_of("fan") is None
    with pytest.raises(ValueError, match="request_id"):
        router.route("r0", short(0), 1, [True, True])


def test_replicas_not_serving_are_skipped_unless_none_serves() -> None:
    router = ReplicaRouter(3, block_size=4)
    assert router.route("a", short(1), 1, [False, True, False]) == 1
    assert router.route("b", short(2), 1, [False, True, False]) == 1
    # Nobody serves (all restarting): the least loaded waits for its core.
    assert router.route("c", short(3), 1, [False, False, False]) == 0


def test_kv_usage_breaks_ties() -> None:
    router = ReplicaRouter(3, block_size=4)
    assert router.route("a", short(1), 1, ALL, [0.9, 0.1, 0.5]) == 1


def test_prefix_affinity_within_the_slack() -> None:
    router = ReplicaRouter(2, block_size=4)
    shared = [9, 9, 9, 9, 1]
    assert router.route("p0", shared, 1, [True, True]) == 0
    # Same first block: stays on replica 0 while it is at most SLACK above the least loaded.
    for i in range(1, PREFIX_AFFINITY_SLACK + 1):
        assert router.route(f"p{i}", shared[:4] + [i], 1, [True, True]) == 0
    assert router.load(0) == PREFIX_AFFINITY_SLACK + 1
    # One more would put it past the slack: the least loaded replica gets it (and the prefix).
    assert router.route("over", shared, 1, [True, True]) == 1
    assert router.route("next", shared, 1, [True, True]) == 1
    # A prompt of one block has no key; a different first block has none recorded.
    assert router.route("short", shared[:4], 1, [True, True]) == 1
    assert router.route("other", [1, 2, 3, 4, 5], 1, [True, True]) == 1


def test_replica_config_gives_each_replica_its_own_cuda_devices(tiny_checkpoint) -> None:
    from ferrum.engine.arg_utils import EngineArgs

    args = EngineArgs(tiny_checkpoint("qwen3"), device="cpu", data_parallel_size=3)
    config = args.create_engine_config()
    assert replica_config(config, 2) is config  # the CPU is shared
    device_config = dataclasses.replace(config.device_config, device="cuda:1")
    cuda = dataclasses.replace(config, device_config=device_config)
    assert [replica_config(cuda, i).device_config.device for i in range(3)] == [
        "cuda:1",
        "cuda:2",
        "cuda:3",
    ]


def test_data_parallel_size_is_validated(tiny_checkpoint) -> None:
    from ferrum.engine.arg_utils import EngineArgs

    for bad in (0, -1, 1.5, True, 65):
        with pytest.raises(ValueError, match="data_parallel_size"):
            EngineArgs(
                tiny_checkpoint("qwen3"), device="cpu", data_parallel_size=bad
            ).create_engine_config()


def test_replica_stats_add_up() -> None:
    first = SchedulerStats(2, 1, 0.5, 10, 4, 1, (1, 2), 30)
    second = SchedulerStats(1, 0, 0.25, 5, 1, 0, (3, 0, 1), 70)
    total = sum_replica_stats([first, None, second], [100, 100, 300])
    assert total is not None
    assert (total.num_running, total.num_waiting) == (3, 1)
    assert (total.prefix_cache_queries, total.prefix_cache_hits, total.num_preemptions) == (
        15,
        5,
        1,
    )
    assert total.iteration_tokens_counts == (4, 2, 1) and total.iteration_tokens_sum == 100
    assert total.kv_cache_usage == pytest.approx((0.5 * 100 + 0.25 * 300) / 500)
    assert sum_replica_stats([None, None], [1, 1]) is None
