"""prompt_logprobs through the whole engine equal transformers' log-softmax of the same
checkpoint's logits: chunked prefill (the chunks' positions are collected in order), preemption
by recompute (positions scored twice are kept once), prefix-cache hits refused while the prompt
must be scored, n > 1, and synchronous and async scheduling."""

from __future__ import annotations

import pytest
import torch

from ferrum import SamplingParams
from ferrum.model_executor.prompt_logprobs import prompt_rows
from ferrum.outputs import RequestOutput
from tests.utils.tiny_checkpoints import hf_logits, load_hf_model
from tests.utils.tiny_llm import make_llm, random_prompts

K = 3
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _check_against_hf(model: torch.nn.Module, output: RequestOutput) -> None:
    prompt = output.prompt_token_ids
    logprobs = output.prompt_logprobs
    assert logprobs is not None and len(logprobs) == len(prompt)
    assert logprobs[0] is None
    reference = hf_logits(model, prompt).log_softmax(dim=-1)
    for position in range(1, len(prompt)):
        entry, expected = logprobs[position], reference[position - 1]
        assert entry is not None
        token_id = prompt[position]
        first_id, first = next(iter(entry.items()))
        assert first_id == token_id  # the prompt token comes first
        assert first.logprob == pytest.approx(float(expected[token_id]), abs=1e-4)
        assert first.rank == int((expected > expected[token_id]).sum()) + 1
        top_values, top_ids = expected.topk(K)
        for rank, (token, value) in enumerate(zip(top_ids.tolist(), top_values.tolist()), 1):
            assert entry[token].logprob == pytest.approx(value, abs=1e-4)
            if token != token_id:
                assert entry[token].rank == rank


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_match_hf_across_chunks_and_preemption(
    tiny_checkpoint, async_scheduling: bool
) -> None:
    path = tiny_checkpoint("qwen3")
    model = load_hf_model(path)
    prompts = random_prompts([23, 9, 14, 1, 11], seed=3)
    # Chunks of at most 7 tokens; 16 usable blocks of 4 tokens: requests get preempted.
    llm = make_llm(
        path,
        num_kv_blocks=17,
        max_num_batched_tokens=7,
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    for output in outputs:
        _check_against_hf(model, output)

    # The same prompts again, two completions each: the prefix cache holds their blocks, but
    # the prompt is computed again to be scored; plain requests still hit the cache.
    kv = llm.llm_engine.core.kv_cache_manager
    hits = kv.prefix_cache_hits
    params = SamplingParams(temperature=1.0, seed=0, n=2, max_tokens=2, prompt_logprobs=K)
    again = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]
    _check_against_hf(model, again)
    assert len(again.outputs) == 2 and kv.prefix_cache_hits == hits
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate({"prompt_token_ids": prompts[0]}, plain, use_tqdm=False)
    assert kv.prefix_cache_hits > hits


def test_without_prompt_logprobs_the_output_has_none(tiny_checkpoint) -> None:
    llm = make_llm(tiny_checkpoint("qwen3"), num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=1)
    output = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0]
    assert output.prompt_logprobs is None


def test_prompt_rows_cover_the_chunk_short_of_the_last_prompt_token() -> None:
    prompt = [10, 11, 12, 13, 14]
    requests = {"a": (prompt, 0, 2), "b": ([7, 8], 0, None), "c": (prompt, 3, 0)}
    rows = prompt_rows(requests, {"a": 3, "b": 2, "c": 2})
    # a: positions 0-2 run, scoring tokens 1-3; c: positions 3-4 run, scoring token 4 only.
    assert [(r.req_id, r.first_row, r.first_position, r.target_ids) for r in rows] == [
        ("a", 0, 1, [11, 12, 13]),
        ("c", 5, 4, [14]),
    ]
