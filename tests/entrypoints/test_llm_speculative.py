"""Speculative decoding through `LLM`: greedy tokens equal those without speculation for every
proposer and acceptance rate (full attention, sliding window, MoE), under chunked prefill,
prefix hits, preemption and `n`; logprobs match; drafts never pass max_tokens or a stop token;
sampled outputs keep the target's distribution (chi-square); unsupported set-ups are refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ferrum import LLM, SamplingParams
from ferrum.errors import FieldError
from tests.utils.speculation import GREEDY, NGRAM, PROMPTS, replay_config
from tests.utils.speculation import generate as generate_over
from tests.utils.tiny_llm import make_llm, random_prompts


def generate(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return generate_over(llm, PROMPTS, params)


@pytest.fixture(scope="module", params=["qwen3", "mistral_sw", "qwen3_moe"])
def checkpoint(request: pytest.FixtureRequest, tiny_checkpoint) -> str:  # noqa: ANN001
    return tiny_checkpoint(request.param)


@pytest.fixture(scope="module")
def expected(checkpoint: str) -> list[list[int]]:
    return generate(make_llm(checkpoint))


def test_ngram_drafts_leave_greedy_tokens_unchanged(checkpoint: str, expected) -> None:  # noqa: ANN001
    llm = make_llm(checkpoint, speculative_config=NGRAM)
    assert generate(llm) == expected
    stats = llm.llm_engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    assert sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.0])
def test_replayed_drafts_at_any_acceptance_rate_leave_greedy_tokens_unchanged(
    checkpoint: str,
    expected,
    rate: float,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    llm = make_llm(
        checkpoint, speculative_config=replay_config(tmp_path / "c.json", expected, rate)
    )
    assert generate(llm) == expected
    stats = llm.llm_engine.stats()
    accepted = stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens
    if rate == 1.0:
        assert accepted == 1.0
        # Every step but the prompt's emits the 4 drafts and a bonus token.
        assert stats.spec_num_drafts == len(PROMPTS) * math.ceil((GREEDY.max_tokens - 1) / 5)
    elif rate == 0.0:
        assert accepted == 0.0
    else:
        assert 0.2 < accepted < 0.8


def test_chunks_prefix_hits_preemption_and_n_keep_greedy_tokens(
    checkpoint: str,
    expected,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    spec = replay_config(tmp_path / "c.json", expected, 0.7)
    chunked = make_llm(checkpoint, speculative_config=spec, max_num_batched_tokens=6)
    assert generate(chunked) == expected
    generate(chunked)  # again: every prompt now hits the prefix cache
    assert chunked.llm_engine.stats().prefix_cache_hits > 0
    if "_sw" not in checkpoint:  # sliding-window layers release old blocks: none runs short
        tight = make_llm(checkpoint, speculative_config=spec, num_kv_blocks=16)
        assert generate(tight) == expected
        assert tight.llm_engine.stats().num_preemptions > 0
    two = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2)
    outputs = make_llm(checkpoint, speculative_config=spec).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], two, use_tqdm=False
    )
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[e, e] for e in expected]


@pytest.mark.parametrize("disable_by_batch_size", [None, 3])
def test_async_scheduling_keeps_greedy_tokens(
    checkpoint: str,
    expected,
    tmp_path: Path,
    disable_by_batch_size: int | None,  # noqa: ANN001
) -> None:
    """Steps run ahead while more requests run than speculate (5 of them, finishing one by one
    until 2 are left), and wait for each other while drafts are verified."""
    spec = replay_config(tmp_path / "c.json", expected, 0.7)
    spec["disable_by_batch_size"] = disable_by_batch_size
    llm = make_llm(checkpoint, speculative_config=spec, async_scheduling=True)
    lengths = [20, 4, 9, 14, 17]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [e[:n] for e, n in zip(expected, lengths)]
    assert llm.llm_engine.stats().spec_num_drafts > 0


def test_logprobs_match_those_without_speculation(checkpoint: str, expected, tmp_path) -> None:  # noqa: ANN001
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)

    def logprobs(llm: LLM) -> list[list[dict[int, float]]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [
            [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]
            for o in outputs
        ]

    base = logprobs(make_llm(checkpoint))
    spec = replay_config(tmp_path / "c.json", expected, 0.7)
    got = logprobs(make_llm(checkpoint, speculative_config=spec))
    assert [[sorted(s) for s in r] for r in got] == [[sorted(s) for s in r] for r in base]
    for row, base_row in zip(got, base):
        for step, base_step in zip(row, base_row):
            for token, value in step.items():
                assert value == pytest.approx(base_step[token], abs=1e-4)


def test_drafts_stop_at_max_tokens_and_stop_tokens(tiny_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    path = tiny_checkpoint("qwen3")
    expected = generate(make_llm(path))
    llm = make_llm(path, speculative_config=replay_config(tmp_path / "c.json", expected, 1.0))
    for max_tokens in (1, 2, 3, 7):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        assert generate(llm, params) == [e[:max_tokens] for e in expected]
    # A stop token inside an accepted draft ends the output there, the drafts after it dropped.
    stop = expected[0][5]
    params = SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop])
    got = generate(llm, params)[0]
    assert got == expected[0][: expected[0].index(stop) + 1]
    assert llm.llm_engine.stats().num_running == 0


def test_sampled_tokens_keep_the_target_distribution(tiny_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    """The first three sampled tokens (top_k=2: 8 outcomes) over 1,500 seeded samples whose
    drafts for the second and third (the greedy continuation) are accepted hundreds of times:
    chi-square against the exact probabilities."""
    path = tiny_checkpoint("qwen3")
    prompt = PROMPTS[0]
    base = make_llm(path)
    exact: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        exact = {
            seq + (t,): p * q
            for seq, p in exact.items()
            for t, q in top_probs(base, prompt + list(seq)).items()
        }
    greedy = generate(base)[0]
    spec = replay_config(tmp_path / "c.json", [greedy] + [[]] * (len(PROMPTS) - 1), 1.0)
    llm = make_llm(path, speculative_config=spec, max_num_seqs=256)
    num_samples = 1500
    params = [
        SamplingParams(temperature=1.0, top_k=2, max_tokens=4, seed=i, ignore_eos=True)
        for i in range(num_samples)
    ]
    outputs = llm.generate([{"prompt_token_ids": prompt}] * num_samples, params, use_tqdm=False)
    counts = dict.fromkeys(exact, 0)
    for o in outputs:
        counts[tuple(o.outputs[0].token_ids[:3])] += 1
    chi2 = sum((counts[k] - num_samples * p) ** 2 / (num_samples * p) for k, p in exact.items())
    assert chi2 < 24.3, (chi2, counts, exact)  # 7 degrees of freedom, p = 0.001
    assert llm.llm_engine.stats().spec_num_accepted_tokens > 300


def test_seeded_samples_equal_those_without_speculation(
    checkpoint: str,
    expected,
    tmp_path: Path,  # noqa: ANN001
) -> None:
    """A seeded request draws once per output token, as without speculation (its generator is
    rewound past the rows of rejected drafts): the same seed gives the same tokens with or
    without speculation, whatever else runs and after a restart."""
    params = [
        SamplingParams(temperature=0.8, max_tokens=20, seed=100 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def sampled(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    spec = replay_config(tmp_path / "c.json", expected, 0.5)
    llm = make_llm(checkpoint, speculative_config=spec)
    assert sampled(llm) == sampled(make_llm(checkpoint))
    stats = llm.llm_engine.stats()
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens  # rejected drafts


def top_probs(llm: LLM, prompt: list[int], k: int = 2) -> dict[int, float]:
    """The next token's top-k probabilities, renormalized (temperature 1)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    step = output.outputs[0].logprobs[0]
    top = sorted(step.items(), key=lambda item: item[1].rank)[:k]
    total = sum(math.exp(lp.logprob) for _, lp in top)
    return {t: math.exp(lp.logprob) / total for t, lp in top}


def draft_config(path: str) -> dict:
    return {
        "method": "draft_model",
        "model": path,
        "num_speculative_tokens": 3,
        "disable_by_batch_size": None,
    }


def test_a_draft_model_leaves_greedy_tokens_unchanged(tiny_checkpoint) -> None:  # noqa: ANN001
    """The target as its own draft: every draft is accepted, also after prefix hits (the
    draft's KV of a cached block is there) and preemptions; another model's drafts: equal
    tokens still, whatever is accepted; a llama draft of the same vocabulary for a qwen3."""
    path = tiny_checkpoint("qwen3")
    expected = generate(make_llm(path))
    same = make_llm(path, speculative_config=draft_config(path), max_num_batched_tokens=6)
    for _ in range(2):
        assert generate(same) == expected
    stats = same.llm_engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.95
    tight = make_llm(path, speculative_config=draft_config(path), num_kv_blocks=16)
    assert generate(tight) == expected
    stats = tight.llm_engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_num_accepted_tokens / stats.spec_num_draft_tokens > 0.95
    for draft in (tiny_checkpoint("qwen3", seed=3), tiny_checkpoint("llama")):
        assert generate(make_llm(path, speculative_config=draft_config(draft))) == expected


def test_draft_models_that_cannot_serve_are_refused(tiny_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    path = tiny_checkpoint("qwen3")
    other_vocab = tiny_checkpoint("qwen3", vocab_size=512)
    with pytest.raises(FieldError, match="vocab_size 512 differs"):
        make_llm(path, speculative_config=draft_config(other_vocab))
    with pytest.raises(FieldError, match="speculative_config.model"):
        make_llm(path, speculative_config=draft_config(str(tmp_path / "missing")))
    with pytest.raises(FieldError, match="full-attention layers"):
        make_llm(tiny_checkpoint("mistral_sw"), speculative_config=draft_config(path))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}}, "method"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "num_spec"),
        ({"speculative_config": {"method": "ngram"}}, "num_speculative_tokens"),
        ({"speculative_config": {**NGRAM, "async_scheduling": True}}, "unknown"),
        ({"speculative_config": NGRAM, "pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ],
)
def test_unsupported_set_ups_are_refused_by_name(
    tiny_checkpoint,
    overrides: dict,
    field: str,  # noqa: ANN001
) -> None:
    with pytest.raises((ValueError, FieldError), match=field):
        make_llm(tiny_checkpoint("qwen3"), **overrides)


def test_drafts_are_proposed_for_live_requests_only(tiny_checkpoint) -> None:  # noqa: ANN001
    """Async scheduling with a draft model and a tight pool: a request preempted (or finished)
    after its step launched gets no drafts from that step; the draft model never decodes into
    blocks the request no longer holds."""
    path = tiny_checkpoint("qwen3")
    spec = {**draft_config(path), "disable_by_batch_size": 2}
    llm = make_llm(path, speculative_config=spec, async_scheduling=True, num_kv_blocks=12)
    runner = llm.llm_engine.core.executor.runner
    propose, stale = runner.speculative.propose, []

    def checked_propose(states, *args):  # noqa: ANN001, ANN002
        stale.extend(s.req_id for s in states if runner.requests.get(s.req_id) is not s)
        return propose(states, *args)

    runner.speculative.propose = checked_propose
    prompts = [p + p[:7] for p in random_prompts([9, 17, 26, 13, 5, 11, 8, 20], seed=4)]
    lengths = [20, 4, 9, 14, 17, 6, 12, 15]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = make_llm(path).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert llm.llm_engine.stats().num_preemptions > 0
    assert stale == []
