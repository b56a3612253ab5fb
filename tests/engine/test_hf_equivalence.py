"""End to end: greedy tokens identical to Hugging Face transformers on tiny random checkpoints.

Each architecture runs through the whole engine (scheduler, paged KV cache, runner, sampler) in
fp32 on the CPU: a plain batch, prefix-cache hits, chunked prefill, and a KV pool so small that
requests get preempted and recomputed.
"""

from __future__ import annotations

import random

import pytest

from ferrum import LLM, SamplingParams
from tests.tiny_checkpoints import hf_greedy

ARCHS = ["llama", "llama3", "qwen2", "qwen3", "qwen3_moe"]
MAX_TOKENS = 10


def random_prompts(lengths: list[int], seed: int, vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(path: str, **kwargs) -> LLM:
    defaults = dict(
        skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4, max_model_len=128
    )
    return LLM(path, **(defaults | kwargs))


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_and_prefix_hits_match_hf(tiny_checkpoint, arch: str) -> None:
    path = tiny_checkpoint(arch)
    prompts = random_prompts([5, 17, 2, 30], seed=1)
    llm = make_llm(path, num_kv_blocks=128)
    assert greedy(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)

    # Same prefixes, new suffixes: the shared full blocks come from the prefix cache.
    kv = llm.llm_engine.core.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    extended = [p + s for p, s in zip(prompts, random_prompts([3, 9, 6, 1], seed=2))]
    assert greedy(llm, extended) == hf_greedy(path, extended, MAX_TOKENS)
    assert kv.prefix_cache_hits - hits_before >= 4 + 16 + 28
    assert kv.usage == 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_and_preemption_match_hf(tiny_checkpoint, arch: str) -> None:
    path = tiny_checkpoint(arch)
    prompts = random_prompts([23, 9, 14, 3, 11], seed=3)
    # 16 usable blocks of 4 tokens: each request fits alone (<= 9 blocks), not all at once.
    llm = make_llm(path, num_kv_blocks=17, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert greedy(llm, prompts) == hf_greedy(path, prompts, MAX_TOKENS)
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert llm.llm_engine.core.kv_cache_manager.usage == 0.0


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
