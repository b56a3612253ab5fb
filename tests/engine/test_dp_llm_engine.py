"""The offline `LLM` over two engine-core processes (data_parallel_size=2) on the shipped model:
the same greedy text as one in-process core, both replicas get requests, stop strings and n
fan-out finish on the replica that holds them, aborts free their replica's KV blocks."""

from __future__ import annotations

import pytest

from ferrum import LLM, SamplingParams
from ferrum.default_model import DEFAULT_MODEL_DIR
from ferrum.engine.dp_client import DataParallelClient

PROMPTS = [
    "Once upon a time",
    "The river was",
    "In the year of the",
    "A long time ago there",
    "She opened the door and",
    "The history of the",
]


@pytest.fixture(scope="module")
def dp_llm():
    llm = LLM(
        DEFAULT_MODEL_DIR,
        dtype="float32",
        device="cpu",
        num_kv_blocks=128,
        max_model_len=512,
        data_parallel_size=2,
        num_cpu_threads=1,
    )
    yield llm
    llm.llm_engine.shutdown()


def test_same_greedy_text_as_one_core_and_both_replicas_serve(dp_llm, shipped_llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = dp_llm.llm_engine
    assert isinstance(engine.client, DataParallelClient)
    before = [s.iteration_tokens_sum if s else 0 for s in engine.replica_stats()]
    got = dp_llm.generate(PROMPTS, params, use_tqdm=False)
    want = shipped_llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    after = [s.iteration_tokens_sum if s else 0 for s in engine.replica_stats()]
    # Each replica computed at least one prompt and its tokens.
    assert all(a - b >= 4 + 8 for a, b in zip(after, before)), (before, after)
    assert engine.client.router.num_open_requests == 0
    assert engine.stats().iteration_tokens_sum == sum(after)


def test_n_completions_and_stop_strings_finish_on_their_replica(dp_llm, shipped_llm) -> None:
    prompt = "The history of the"
    full = (
        shipped_llm.generate(
            prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )[0]
        .outputs[0]
        .text
    )
    stop = full[5:11]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]),
        SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=6, ignore_eos=True),
    ]
    stopped, fanned = dp_llm.generate([prompt, prompt], params, use_tqdm=False)
    assert stopped.outputs[0].text == full[: full.index(stop)]
    assert stopped.outputs[0].finish_reason == "stop"
    assert [len(c.token_ids) for c in fanned.outputs] == [6, 6, 6]
    engine = dp_llm.llm_engine
    assert engine.client.router.num_open_requests == 0
    assert engine.client.router.load(0) == engine.client.router.load(1) == 0


def test_abort_frees_the_replicas_blocks(dp_llm) -> None:
    engine = dp_llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"abort-{i}", prompt, params)
    replicas = {engine.client.router.replica_of(f"abort-{i}") for i in range(2)}
    assert replicas == {0, 1}
    # Bounded: each step returns the outputs of at least one core step.
    for _ in range(200):
        engine.step()
        stats = engine.replica_stats()
        if all(s is not None and s.kv_cache_usage > 0 for s in stats):
            break
    else:
        pytest.fail(f"the requests never held KV blocks on both replicas: {stats}")
    engine.abort_request(["abort-0", "abort-1"])
    assert not engine.has_unfinished_requests()
    assert engine.client.router.load(0) == engine.client.router.load(1) == 0
    # Each core frees the aborted blocks before its next step: after one more request on each,
    # both pools are empty.
    dp_llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [s.kv_cache_usage for s in engine.replica_stats()] == [0.0, 0.0]
