"""The Ray executor through `LLM`, on a local Ray instance on the CPU (gloo): two actors give the
greedy tokens of one process (prefix hits, chunked prefill, preemption, async scheduling);
a rank that raises fails the executor with its traceback; constrained requests (rows inline in
the step) sample what one process does; a killed actor fails the step at once and wakes an idle
core; shutdown leaves no actor and no placement group; a group no node can hold fails start-up.

One Ray start per module (seconds): every test shares it."""

from __future__ import annotations

from collections.abc import Iterator
from multiprocessing.connection import wait

import pytest

from ferrum import LLM, SamplingParams
from ferrum.executor import WorkerDiedError, WorkerStepError, ray_cluster
from tests.utils.constrained_requests import assert_valid, constrained_texts, one_process_texts
from tests.utils.processes import wait_until
from tests.utils.tiny_llm import greedy, make_llm, random_prompts

ray = pytest.importorskip("ray")
from ray.exceptions import RayActorError  # noqa: E402
from ray.util import placement_group_table  # noqa: E402

WORLD_SIZE = 2
ENGINE = dict(num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, num_cpu_threads=1)
PROMPT_LENGTHS = [9, 23, 30, 14, 27, 5]


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    # The executor joins the instance this process started (ray.is_initialized()).
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:  # noqa: ANN001 - the session factory
    return tiny_checkpoint("qwen3")


def ray_llm(path: str, **kwargs: object) -> LLM:
    args = {"tensor_parallel_size": WORLD_SIZE, "async_scheduling": True} | ENGINE | kwargs
    return make_llm(path, distributed_executor_backend="ray", **args)


def is_dead(actor: object) -> bool:
    try:
        ray.get(actor.placement.remote(), timeout=30)  # type: ignore[attr-defined]
    except RayActorError:
        return True
    return False


def wait_all_dead(actors: list[object]) -> None:
    """`ray.kill` is asynchronous: a call sent just after it may still be answered."""
    wait_until(lambda: all(is_dead(a) for a in actors), 60, "every Ray actor dead")


def assert_released(executor: object) -> None:
    """Every actor of the executor is dead and its placement groups removed."""
    wait_all_dead(executor._actors)  # type: ignore[attr-defined]
    groups = executor._placement_groups  # type: ignore[attr-defined]
    wait_until(
        lambda: all(placement_group_table(g)["state"] == "REMOVED" for g in groups),
        60,
        "every placement group removed",
    )


def test_ray_workers_give_the_greedy_tokens_of_one_process_and_report_a_raising_rank(
    checkpoint: str,
) -> None:
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    prompts += [prompts[1][:20] + [7, 8, 9], prompts[2][:24] + [11]]
    one = make_llm(checkpoint, **ENGINE)
    expected = greedy(one, prompts) + greedy(one, prompts)  # the second round hits the cache
    llm = ray_llm(checkpoint)
    executor = llm.llm_engine.core.executor
    try:
        assert not any(is_dead(a) for a in executor._actors)
        assert greedy(llm, prompts) + greedy(llm, prompts) == expected
        stats = llm.llm_engine.stats()
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hits > 0
        # A rank whose call raises fails the executor with the rank's traceback.
        with pytest.raises(
            WorkerStepError, match=r"worker \d failed: (.|\n)*unknown message 'bogus'"
        ):
            executor._call_all("bogus")
        wait_all_dead(executor._actors)
    finally:
        llm.llm_engine.core.shutdown()
    assert_released(executor)


def test_constrained_requests_match_one_process() -> None:
    # Async scheduling defers a constrained step's sampling: its rows follow in SampleStep.
    expected = list(one_process_texts(async_scheduling=True))
    texts = constrained_texts(
        async_scheduling=True, tensor_parallel_size=WORLD_SIZE, distributed_executor_backend="ray"
    )
    assert texts == expected
    assert_valid(texts)


def test_killed_actor_fails_the_step_and_wakes_the_idle_core(checkpoint: str) -> None:
    llm = ray_llm(checkpoint)
    engine = llm.llm_engine
    executor = engine.core.executor
    try:
        params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8]}, params)
        engine.add_request("b", {"prompt_token_ids": [9, 10, 11]}, params)
        engine.step()
        engine.step()
        rank = WORLD_SIZE - 1
        ray.kill(executor._actors[rank])
        # The monitor notices at once, without a step: an idle core's wait wakes.
        assert wait(executor.failure_sentinels, timeout=30)
        with pytest.raises(WorkerDiedError, match=rf"worker {rank} \(Ray actor\) died"):
            executor.check_health()
        with pytest.raises(WorkerDiedError, match=rf"worker {rank} \(Ray actor\) died"):
            engine.step()
        with pytest.raises(WorkerDiedError):  # the executor stays failed
            engine.step()
        wait_all_dead(executor._actors)
    finally:
        engine.core.shutdown()  # after a failure too
    assert_released(executor)


def test_data_parallel_replicas_share_the_cluster_and_keep_their_requests(
    checkpoint: str,
) -> None:
    # Two replica cores (processes) of two actors each join this process's Ray instance.
    from ferrum.engine.dp_client import DataParallelClient

    prompts = random_prompts(PROMPT_LENGTHS, seed=5)
    expected = greedy(make_llm(checkpoint, **ENGINE), prompts)
    llm = ray_llm(checkpoint, data_parallel_size=2)
    engine = llm.llm_engine
    assert isinstance(engine.client, DataParallelClient)
    try:
        # Both replicas' four actors hold this instance's CPUs, not instances of their own.
        assert ray.available_resources().get("CPU", 0.0) == pytest.approx(2 - 4 * 0.25)
        assert greedy(llm, prompts) == expected
        served = [s.iteration_tokens_sum for s in engine.replica_stats()]
        assert all(n > 0 for n in served), served
        # An abort frees the blocks of the replica that holds the request.
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        engine.add_request("held", {"prompt_token_ids": prompts[0]}, params)
        replica = engine.client.router.replica_of("held")
        for _ in range(100):
            engine.step()
            stats = engine.replica_stats()[replica]
            if stats is not None and stats.kv_cache_usage > 0:
                break
        engine.abort_request("held")
        assert engine.client.router.load(replica) == 0
        greedy(llm, prompts[:2])  # the core frees the aborted blocks before its next step
        assert [s.kv_cache_usage for s in engine.replica_stats()] == [0.0, 0.0]  # type: ignore[union-attr]
    finally:
        engine.shutdown()
    wait_until(lambda: ray.available_resources().get("CPU") == 2.0, 30, "the actors released")


def test_a_group_no_node_can_hold_fails_naming_the_free_resources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No node has a GPU: the group never becomes ready, however long start-up would wait.
    monkeypatch.setattr(ray_cluster, "PLACEMENT_TIMEOUT", 0.2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: no node .* 2 x \{'GPU': 1\}"):
        ray_cluster.reserve(ray, [{"GPU": 1}] * 2)  # a CPU-only cluster


def test_dropped_engines_release_their_actors_and_groups(checkpoint: str) -> None:
    # Each dropped engine gives its actor (0.25 CPU) and placement group back at once: the
    # collected LLM stops its core (one rank each, to keep the test short). Every round checks
    # the release, so two rounds (the second engine made after the first was dropped) cover it.
    prompts = random_prompts([7], seed=9)
    for _ in range(2):
        llm = ray_llm(checkpoint, tensor_parallel_size=1)
        assert len(greedy(llm, prompts)[0]) > 0
        del llm
        wait_until(lambda: ray.available_resources().get("CPU") == 2.0, 30, "the actors released")
        wait_until(
            lambda: all(g["state"] == "REMOVED" for g in placement_group_table().values()),
            30,
            "the placement groups removed",
        )
