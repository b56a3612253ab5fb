"""Async scheduling (step N+1 scheduled and launched before step N's tokens reach the host) gives
the same tokens as the synchronous engine: greedy equals Hugging Face, seeded sampling, stop
rules, penalties (which fall back to waiting), preemption and failures lose nothing."""

from __future__ import annotations

import pytest

from ferrum import SamplingParams
from tests.utils.faults import fail_forward
from tests.utils.tiny_checkpoints import hf_greedy
from tests.utils.tiny_llm import MAX_TOKENS, greedy, make_llm, random_prompts


def generate(llm, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_sampling_and_stop_rules_match_synchronous(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([9, 4, 15], seed=7)
    cases = [
        # seeded random sampling with logprobs
        SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=9, logprobs=2),
        # stop token ids and min_tokens (masked on the device with the pending token counted)
        SamplingParams(
            temperature=1.0, seed=3, max_tokens=12, min_tokens=4, stop_token_ids=[1, 2, 3, 5, 8]
        ),
        # penalties: the engine waits for each step's tokens before scheduling the next
        SamplingParams(
            temperature=0.7,
            seed=5,
            max_tokens=10,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.2,
        ),
    ]
    sync_llm = make_llm(path, num_kv_blocks=64, async_scheduling=False)
    async_llm = make_llm(path, num_kv_blocks=64, async_scheduling=True)
    for params in cases:
        expected = sync_llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        got = async_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for e, g in zip(expected, got):
            assert g.outputs[0].token_ids == e.outputs[0].token_ids
            assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
            assert g.outputs[0].logprobs == e.outputs[0].logprobs
    assert async_llm.llm_engine.core.kv_cache_manager.usage == 0.0


def test_requests_finishing_at_different_steps_lose_no_token(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([6, 11, 3, 8], seed=9)
    llm = make_llm(path, num_kv_blocks=64, async_scheduling=True)
    engine = llm.llm_engine
    lengths = [1, 2, 5, 3]
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    expected = [hf_greedy(path, [p], n)[0] for p, n in zip(prompts, lengths)]
    assert [finished[str(i)] for i in range(4)] == expected
    # No request ran past its max_tokens: nothing is left to free.
    assert engine.core.kv_cache_manager.usage == 0.0


def test_abort_while_a_step_is_in_flight(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([7, 12], seed=13)
    llm = make_llm(path, num_kv_blocks=64, async_scheduling=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    engine.step()
    engine.step()
    engine.abort_request(["0"])
    tokens = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.request_id == "1"
            tokens = output.outputs[0].token_ids
    assert tokens == hf_greedy(path, [prompts[1]], MAX_TOKENS)[0]
    assert engine.core.kv_cache_manager.usage == 0.0


def test_failed_launch_keeps_the_previous_steps_tokens(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([21, 13], seed=31)
    llm = make_llm(path, num_kv_blocks=64, async_scheduling=True)
    engine = llm.llm_engine
    fail_forward(monkeypatch, engine.core.executor.runner.model, at_call=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[int]] = {}
    failures = 0
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except RuntimeError:
            failures += 1
            continue
        for output in outputs:
            tokens[output.request_id] = output.outputs[0].token_ids
    assert failures == 1
    assert [tokens["0"], tokens["1"]] == hf_greedy(path, prompts, MAX_TOKENS)
    assert engine.core.kv_cache_manager.usage == 0.0
    # Prefix-cache entries of the failed step were dropped: hits serve correct KV.
    assert greedy(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)


def test_request_id_reused_while_a_stale_step_is_in_flight(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    first, second = random_prompts([6, 9], seed=17)
    expected_first = hf_greedy(path, [first], 3)[0]
    llm = make_llm(path, num_kv_blocks=64, async_scheduling=True)
    engine = llm.llm_engine
    # Stops on its second token: the step after it was already launched with its decode.
    stop_on_second = SamplingParams(
        temperature=0.0, max_tokens=8, stop_token_ids=[expected_first[1]], ignore_eos=True
    )
    engine.add_request("x", {"prompt_token_ids": first}, stop_on_second)
    done = []
    while engine.has_unfinished_requests():
        done += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    scheduled = engine.core._in_flight[0][0].num_scheduled_tokens
    assert scheduled == {"x": 1}
    engine.add_request(
        "x",
        {"prompt_token_ids": second},
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
    )
    while engine.has_unfinished_requests():
        done += [o.outputs[0].token_ids for o in engine.step() if o.finished]
    assert done == [expected_first[:2], hf_greedy(path, [second], 3)[0]]


def test_a_finished_requests_last_block_is_cached_as_in_synchronous_mode(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    prompt = random_prompts([9], seed=5)[0]
    # 9 + 12 tokens: the last step's input closes block 4 (positions 16-19) while it is still a
    # placeholder, and the request ends with that step.
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    hits = []
    for async_scheduling in (False, True):
        llm = make_llm(path, num_kv_blocks=64, async_scheduling=async_scheduling)
        first = generate(llm, [prompt], params)[0]
        follow_up = prompt + first + [1, 2, 3]
        out = llm.generate([{"prompt_token_ids": follow_up}], params, use_tqdm=False)[0]
        hits.append(out.num_cached_tokens)
    assert hits == [20, 20]
