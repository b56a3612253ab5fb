"""A forward that raises leaves no half-written KV in the prefix cache and loses no request."""

from __future__ import annotations

import pytest

from ferrum import SamplingParams
from tests.utils.faults import fail_forward
from tests.utils.tiny_checkpoints import hf_greedy
from tests.utils.tiny_llm import MAX_TOKENS, greedy, make_llm, random_prompts


def test_failed_forward_is_recovered(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_checkpoint("qwen3")
    llm = make_llm(path, num_kv_blocks=64)
    engine = llm.llm_engine
    prompts = random_prompts([21, 13], seed=31)
    fail_forward(monkeypatch, engine.core.executor.runner.model, at_call=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    # The blocks registered for the failed step are not in the prefix cache.
    assert engine.core.kv_cache_manager.groups[0].block_pool.num_cached_blocks == 0
    # The same engine goes on: the requests are recomputed and come out right.
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output.outputs[0].token_ids
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    assert [outputs["0"], outputs["1"]] == expected
    # Prefix-cache hits after the failure serve correct KV.
    assert greedy(llm, prompts) == expected


def test_a_launch_failing_before_the_runner_reads_the_step_loses_no_cleanup(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = make_llm(tiny_checkpoint("qwen3"), num_kv_blocks=64)
    engine = llm.llm_engine
    runner = engine.core.executor.runner
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=2, ignore_eos=True)
    engine.add_request("done", {"prompt_token_ids": [1, 2, 3]}, seeded)
    while engine.has_unfinished_requests():
        engine.step()
    assert "done" in runner.requests  # forgotten at the next step
    real_launch = runner.launch

    def failing_launch(scheduler_output, matchers=None, defer_sampling=False):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(runner, "launch", failing_launch)
    engine.add_request("next", {"prompt_token_ids": [4, 5]}, seeded)
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    monkeypatch.setattr(runner, "launch", real_launch)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    assert "done" not in runner.requests and "done" not in runner.requests.generators
