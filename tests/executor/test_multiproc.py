"""The multiprocess executor through `LLM`, on the CPU (gloo): worker processes give the greedy
tokens of one process, through prefix hits, chunked prefill, preemption and async
scheduling; constrained requests with async scheduling (deferred sampling) sample what one
process does; a killed worker fails the step at once and leaves no process behind. (Shutdown:
tests/entrypoints/openai/test_server_tp.py.)"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest

from ferrum import LLM, SamplingParams
from ferrum.executor import WorkerDiedError, WorkerStepError
from tests.utils.constrained_requests import assert_valid, constrained_texts, one_process_texts
from tests.utils.processes import is_running, wait_gone, wait_until
from tests.utils.tiny_llm import greedy, make_llm, random_prompts

# A 96-token KV pool, 16-token steps and 4 requests at a time: the prompts below are chunked,
# and preempt each other.
# Ranks of the tested engines (one worker process each), beside a one-process engine.
WORLD_SIZE = 2
ENGINE = dict(num_kv_blocks=24, max_num_batched_tokens=16, max_num_seqs=4, num_cpu_threads=1)
PROMPT_LENGTHS = [9, 23, 30, 14, 27, 5]


def prompts_with_shared_prefixes() -> list[list[int]]:
    prompts = random_prompts(PROMPT_LENGTHS, seed=3)
    return prompts + [prompts[1][:20] + [7, 8, 9], prompts[2][:24] + [11]]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:  # noqa: ANN001 - the session factory
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def mp_llm(checkpoint: str) -> Iterator[LLM]:
    llm = make_llm(
        checkpoint,
        tensor_parallel_size=WORLD_SIZE,
        distributed_executor_backend="mp",
        async_scheduling=True,
        **ENGINE,
    )
    yield llm
    llm.llm_engine.core.shutdown()


def test_worker_processes_give_the_greedy_tokens_of_one_process(
    checkpoint: str, mp_llm: LLM
) -> None:
    one = make_llm(checkpoint, **ENGINE)
    prompts = prompts_with_shared_prefixes()
    # Twice: the second round hits the prefix cache.
    expected = greedy(one, prompts) + greedy(one, prompts)
    assert greedy(mp_llm, prompts) + greedy(mp_llm, prompts) == expected
    stats = mp_llm.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0
    assert max(PROMPT_LENGTHS) > ENGINE["max_num_batched_tokens"]  # chunked prefill
    assert not mp_llm.llm_engine.has_unfinished_requests()


def test_each_worker_is_its_own_process(mp_llm: LLM) -> None:
    pids = mp_llm.llm_engine.core.executor.worker_pids
    assert len(set(pids)) == WORLD_SIZE and os.getpid() not in pids
    assert all(map(is_running, pids))


def test_constrained_requests_with_async_scheduling_match_one_process() -> None:
    # Async scheduling defers a constrained step's sampling: the core fills the rows once the
    # previous step's tokens reached its matchers and sends them after the step.
    expected = list(one_process_texts(async_scheduling=True))
    texts = constrained_texts(
        async_scheduling=True, tensor_parallel_size=WORLD_SIZE, distributed_executor_backend="mp"
    )
    assert texts == expected
    assert_valid(texts)


def test_constrained_requests_speculate_across_worker_processes() -> None:
    """n-gram drafts for constrained requests under async scheduling: the core fills each verify
    row's mask after the drafts before it, the ranks read a request's rows where it put them;
    the texts equal one process's without speculation, and drafts are accepted."""
    from ferrum.default_model import DEFAULT_MODEL_DIR
    from ferrum.sampling_params import StructuredOutputsParams

    prompts = ["a b a b a b a", "The answer is"]
    regex = StructuredOutputsParams(regex="( b a){6}")
    json_object = StructuredOutputsParams(json={"type": "object", "required": ["ok"]})
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=regex),
        SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=json_object),
    ]
    kwargs = dict(dtype="float32", device="cpu", max_model_len=256, num_cpu_threads=1)

    def texts(llm: LLM) -> list[str]:
        try:
            return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    expected = texts(LLM(DEFAULT_MODEL_DIR, **kwargs))
    llm = LLM(
        DEFAULT_MODEL_DIR,
        tensor_parallel_size=WORLD_SIZE,
        distributed_executor_backend="mp",
        async_scheduling=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        **kwargs,
    )
    got = texts(llm)
    assert got == expected and got[0] == " b a" * 6
    assert llm.llm_engine.stats().spec_num_accepted_tokens > 0


def test_killed_worker_fails_the_step_and_no_worker_survives(mp_llm: LLM) -> None:
    # Last in this module: it leaves the shared engine failed.
    engine = mp_llm.llm_engine
    pids = engine.core.executor.worker_pids
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8]}, params)
    engine.add_request("b", {"prompt_token_ids": [9, 10, 11]}, params)
    engine.step()
    engine.step()
    rank = WORLD_SIZE - 1
    os.kill(pids[rank], signal.SIGKILL)
    # Dead (a zombie until the executor reaps it): its pipes are closed now.
    wait_until(lambda: not is_running(pids[rank]), 30, "the killed worker died")
    killed = rf"worker {rank} \(pid {pids[rank]}\) was killed by SIGKILL"
    with pytest.raises(WorkerDiedError, match=killed):
        engine.step()
    wait_gone(pids)
    with pytest.raises(WorkerDiedError):  # the executor stays failed
        engine.step()
    engine.core.shutdown()  # after a failure too


def test_hung_worker_fails_the_step_within_the_timeout(checkpoint: str) -> None:
    llm = make_llm(
        checkpoint,
        tensor_parallel_size=WORLD_SIZE,
        distributed_executor_backend="mp",
        worker_step_timeout=1.5,
        **ENGINE,
    )
    engine = llm.llm_engine
    pids = engine.core.executor.worker_pids
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8]}, params)
    engine.step()
    os.kill(pids[1], signal.SIGSTOP)  # alive, holds its pipes, never answers
    try:
        with pytest.raises(WorkerStepError, match=r"worker_step_timeout=1.5 s: a worker hangs"):
            for _ in range(100):
                engine.step()
        wait_gone(pids)  # killed, the stopped one too
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        engine.core.shutdown()
