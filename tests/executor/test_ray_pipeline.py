"""Pipeline parallelism on a Ray cluster of two nodes (simulated on this machine, CPU, gloo):
each stage's placement group lands on its own node and the stages give the greedy tokens of
one process, through prefix hits, chunked prefill and preemption."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ferrum.executor import ray_executor
from tests.utils.tiny_llm import greedy, make_llm, random_prompts

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

ENGINE = dict(num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, num_cpu_threads=1)


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[list[str]]:
    """A head without CPUs (only this driver) and two nodes of one CPU each; their node ids."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        yield [node.node_id for node in nodes]
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_two_stages_on_two_nodes_give_the_tokens_of_one_process(
    tiny_checkpoint, two_node_cluster: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rank takes a whole CPU: one stage fills a node, so the stages cannot share one.
    monkeypatch.setattr(ray_executor, "CPU_RANK_SHARE", 1.0)
    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([9, 23, 30, 14, 27, 5], seed=3)
    expected = greedy(make_llm(path, **ENGINE), prompts)
    llm = make_llm(
        path,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        async_scheduling=True,
        **ENGINE,
    )
    try:
        executor = llm.llm_engine.core.executor
        placements = ray.get([actor.placement.remote() for actor in executor._actors])
        assert sorted(node for node, _ in placements) == sorted(two_node_cluster)
        assert greedy(llm, prompts) + greedy(llm, prompts) == expected + expected
        stats = llm.llm_engine.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    finally:
        llm.llm_engine.core.shutdown()
