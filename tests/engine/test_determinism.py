"""Outputs do not depend on the batch a request runs in, and seeded sampling reproduces."""

from __future__ import annotations

from ferrum import SamplingParams
from tests.utils.tiny_llm import greedy, make_llm, random_prompts


def test_greedy_tokens_do_not_depend_on_the_batch(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    prompts = random_prompts([4, 19, 8, 27, 1, 12], seed=4)
    llm = make_llm(path, num_kv_blocks=256, enable_prefix_caching=False)
    alone = [greedy(llm, [p])[0] for p in prompts]
    assert greedy(llm, prompts) == alone


def test_seeded_sampling_does_not_depend_on_the_batch(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3")
    llm = make_llm(path, num_kv_blocks=256)
    target = {"prompt_token_ids": random_prompts([9], seed=5)[0]}
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    noise = SamplingParams(temperature=1.3, max_tokens=7, ignore_eos=True)
    alone = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts([3, 15, 6], seed=6)]
    batch = llm.generate(
        others[:2] + [target] + others[2:], [noise, noise, seeded, noise], use_tqdm=False
    )
    assert batch[2].outputs[0].token_ids == alone
    again = llm.generate(target, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


def test_n_completions_with_seed_are_distinct_and_reproducible(tiny_checkpoint) -> None:
    llm = make_llm(tiny_checkpoint("qwen3"), num_kv_blocks=256)
    prompt = {"prompt_token_ids": random_prompts([7], seed=7)[0]}
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    tokens = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert tokens == [c.token_ids for c in second.outputs]
    assert len({tuple(t) for t in tokens}) == 3
