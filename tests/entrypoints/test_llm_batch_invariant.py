"""`batch_invariant=True` through `LLM`: a probe's greedy tokens and logprobs are bitwise the same
alone, in a batch of other prompts, with its prompt chunked, after a prefix-cache hit, after a
preemption and with async scheduling; its generated tokens' logprobs equal their prompt logprobs
when the same text is a prompt. Models with linear-attention layers are refused by name."""

from __future__ import annotations

import pytest

from ferrum import LLM, SamplingParams
from tests.utils.tiny_llm import make_llm, random_prompts

PROBES = random_prompts([9, 17, 26, 13], seed=11)
OTHERS = random_prompts([5, 30, 21, 8, 14, 27, 3, 19, 11, 24], seed=12)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
ENGINE = dict(batch_invariant=True, max_num_seqs=16, num_kv_blocks=160)

Result = tuple[list[int], list[list[tuple[int, float, int]]]]


def results(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[Result]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, steps(o.outputs[0].logprobs)) for o in outputs]


def steps(logprobs: list) -> list[list[tuple[int, float, int]]]:  # noqa: ANN001
    return [sorted((t, lp.logprob, lp.rank) for t, lp in step.items()) for step in logprobs]


def alone(path: str, **kwargs: object) -> list[Result]:
    llm = make_llm(path, **(ENGINE | kwargs))
    return [results(llm, [p])[0] for p in PROBES]


def in_a_batch(llm: LLM) -> list[Result]:
    """The probes among the other prompts, in one call; their results in probe order."""
    mixed = OTHERS[:3] + PROBES[:2] + OTHERS[3:7] + PROBES[2:] + OTHERS[7:]
    got = results(llm, mixed)
    return [got[mixed.index(p)] for p in PROBES]


@pytest.fixture(scope="module", params=["qwen3", "mistral_sw", "qwen3_moe"])
def checkpoint(request: pytest.FixtureRequest, tiny_checkpoint) -> str:  # noqa: ANN001
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def expected(checkpoint: str) -> list[Result]:
    return alone(checkpoint)


def test_a_batch_chunking_and_async_scheduling_leave_the_probes_unchanged(
    checkpoint: str, expected: list[Result]
) -> None:
    assert in_a_batch(make_llm(checkpoint, **ENGINE)) == expected
    chunked = make_llm(checkpoint, **ENGINE, max_num_batched_tokens=7, async_scheduling=True)
    assert in_a_batch(chunked) == expected


def test_prefix_hits_and_preemption_leave_the_probes_unchanged(
    checkpoint: str, expected: list[Result]
) -> None:
    llm = make_llm(checkpoint, **ENGINE)
    # Other prompts sharing each probe's first 8 tokens fill the prefix cache first.
    results(llm, [p[:8] + o[:5] for p, o in zip(PROBES, OTHERS)])
    assert in_a_batch(llm) == expected
    assert llm.llm_engine.stats().prefix_cache_hits > 0
    tight = make_llm(checkpoint, **(ENGINE | {"num_kv_blocks": 16}))
    assert in_a_batch(tight) == expected
    assert tight.llm_engine.stats().num_preemptions > 0


def test_generated_logprobs_equal_the_prompt_logprobs_of_the_same_text(
    checkpoint: str, expected: list[Result]
) -> None:
    llm = make_llm(checkpoint, **ENGINE)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2, temperature=0.0)
    texts = [{"prompt_token_ids": p + tokens} for p, (tokens, _) in zip(PROBES, expected)]
    for probe, (tokens, logprobs), output in zip(
        PROBES, expected, llm.generate(texts, params, use_tqdm=False)
    ):
        prompt_logprobs = output.prompt_logprobs[len(probe) :]
        for token, step, prompt_step in zip(tokens, logprobs, prompt_logprobs):
            sampled = next(lp for t, lp, _ in step if t == token)
            assert prompt_step[token].logprob == sampled


def test_the_triton_kernels_in_the_interpreter_are_batch_invariant(tiny_checkpoint) -> None:  # noqa: ANN001
    # Fewer and shorter requests: the interpreter runs each kernel in numpy.
    path = tiny_checkpoint("qwen3")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    probe, others = PROBES[1], [OTHERS[1], OTHERS[3]]
    llm = make_llm(path, **ENGINE, kernel_backend="triton")
    expected = results(llm, [probe], params)
    chunked = make_llm(path, **ENGINE, kernel_backend="triton", max_num_batched_tokens=7)
    assert results(chunked, [others[0], probe, others[1]], params)[1] == expected[0]


def test_models_with_linear_attention_are_refused(tiny_checkpoint) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="batch_invariant: not supported for Qwen3_5"):
        make_llm(tiny_checkpoint("qwen3_5"), batch_invariant=True)


def test_two_tensor_parallel_ranks_are_batch_invariant(tiny_checkpoint) -> None:  # noqa: ANN001
    # All-reduces sum the ranks' partials in rank order, whatever the message size.
    path = tiny_checkpoint("qwen3")
    llm = make_llm(path, **ENGINE, tensor_parallel_size=2, max_num_batched_tokens=7)
    expected = [results(llm, [p])[0] for p in PROBES[:2]]
    assert in_a_batch(llm)[:2] == expected
