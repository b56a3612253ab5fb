"""EngineCore: a request resumed with the output tokens a failed core already produced continues
exactly as it would have (greedy, seeded sampling, penalties, min_tokens), and a step that
raises names its requests."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from ferrum import SamplingParams
from ferrum.engine.core import EngineCore
from ferrum.engine.core_messages import EngineCoreRequest
from tests.utils.tiny_llm import make_llm, random_prompts

NUM_TOKENS = 16


def run_to_end(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = defaultdict(list)
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.req_id].extend(output.new_token_ids)
    return tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.9, seed=1234),
        SamplingParams(
            temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3
        ),
        SamplingParams(temperature=0.8, seed=7, frequency_penalty=1.0),
    ],
    ids=["greedy", "seeded", "penalties", "seeded-penalties"],
)
def test_resumed_request_continues_exactly(tiny_checkpoint, params: SamplingParams) -> None:
    llm = make_llm(tiny_checkpoint("qwen3"), num_kv_blocks=128)
    engine = llm.llm_engine
    params = dataclasses.replace(params, max_tokens=NUM_TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": random_prompts([11], seed=3)[0]}
    (request,) = engine.input_processor.process("whole", prompt, params).core_requests
    whole = run_to_end(engine.core, [request])["whole"]
    assert len(whole) == NUM_TOKENS
    resumed = [
        dataclasses.replace(request, req_id=f"after-{k}", output_token_ids=whole[:k])
        for k in (1, 6, NUM_TOKENS - 1)
    ]
    tokens = run_to_end(engine.core, resumed)
    for r in resumed:
        k = len(r.output_token_ids)
        assert tokens[r.req_id] == whole[k:], r.req_id


def test_resumed_request_counts_earlier_tokens_for_min_tokens(tiny_checkpoint) -> None:
    llm = make_llm(tiny_checkpoint("qwen3"), num_kv_blocks=128)
    engine = llm.llm_engine
    prompt = {"prompt_token_ids": random_prompts([9], seed=8)[0]}
    free = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    (request,) = engine.input_processor.process("free", prompt, free).core_requests
    free_tokens = run_to_end(engine.core, [request])["free"]
    # Stopping on the 6th token needs min_tokens to count the 4 tokens a resumed request had.
    assert free_tokens[5] not in free_tokens[:5]
    stop = SamplingParams(
        temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=5, stop_token_ids=[free_tokens[5]]
    )
    stop.ignore_eos = True
    (request,) = engine.input_processor.process("stop", prompt, stop).core_requests
    whole = run_to_end(engine.core, [request])["stop"]
    assert whole == free_tokens[:6]
    resumed = dataclasses.replace(request, req_id="resumed", output_token_ids=whole[:4])
    assert run_to_end(engine.core, [resumed])["resumed"] == whole[4:]


def test_a_raising_step_names_its_requests(tiny_checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("FERRUM_DEBUG_FAIL_ON_TOKEN", "199")
    core = make_llm(tiny_checkpoint("qwen3"), num_kv_blocks=128).llm_engine.core
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True).resolve()
    clean = EngineCoreRequest("clean", [1, 2, 3], params, None, 0.0)
    poisoned = EngineCoreRequest("poisoned", [4, 199, 5], params, None, 0.0)
    core.add_request(clean)
    core.step()
    core.add_request(poisoned)
    with pytest.raises(RuntimeError, match=r"token 199 in the prompt of \['poisoned'\]"):
        core.step()
    assert core.failed_step_req_ids == ["clean", "poisoned"]
    core.finish_requests(["poisoned"])
    core.step()
    assert core.failed_step_req_ids == []
