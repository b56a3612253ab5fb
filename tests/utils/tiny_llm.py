"""An `LLM` over a tiny random checkpoint (token ids in, token ids out) and greedy decoding on it.

`make_llm` runs on the CPU in fp32 with 4-token blocks, `cuda_llm` on CUDA with 16-token blocks
(CUDA graphs and Triton kernels by default); keyword arguments override either's defaults.
"""

from __future__ import annotations

import random

from ferrum import LLM, SamplingParams

# Tokens each greedy comparison generates.
MAX_TOKENS = 10


def random_prompts(lengths: list[int], seed: int, vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """`max_tokens` greedy tokens per prompt, ignoring EOS (like `hf_greedy`)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    return [o.outputs[0].token_ids for o in outputs]


def make_llm(path: str, **kwargs) -> LLM:
    defaults = dict(
        skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4, max_model_len=128
    )
    return LLM(path, **(defaults | kwargs))


def cuda_llm(path: str, **kwargs) -> LLM:
    defaults = dict(
        skip_tokenizer_init=True,
        dtype="float32",
        device="cuda",
        block_size=16,
        max_model_len=256,
        max_num_seqs=16,
    )
    return LLM(path, **(defaults | kwargs))


def teacher_forced_agreement(
    reference: LLM, prompts: list[list[int]], outputs: list[list[int]]
) -> float:
    """The fraction of the generated tokens that are also `reference`'s most likely token after
    the same prefix (teacher forcing: one disagreement does not change what follows)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    results = reference.generate(
        [{"prompt_token_ids": p + o} for p, o in zip(prompts, outputs)], params, use_tqdm=False
    )
    ranks = [
        result.prompt_logprobs[i][token].rank
        for result, p, o in zip(results, prompts, outputs)
        for i, token in enumerate(o, start=len(p))
    ]
    return sum(rank == 1 for rank in ranks) / len(ranks)
