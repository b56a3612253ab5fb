from __future__ import annotations

import math

import pytest
import torch

from ferrum.model_executor.sampler import (
    Sampler,
    advance_sampling_generator,
    apply_min_p,
    apply_penalties,
    apply_token_constraints,
    apply_top_k_top_p,
)
from ferrum.model_executor.sampling_metadata import SamplingMetadata, SamplingRow, sampling_staging
from ferrum.model_executor.token_bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_reference,
)
from ferrum.sampling_params import ResolvedSamplingParams, SamplingParams

CPU = torch.device("cpu")
NEG_INF = float("-inf")


def _row(
    params: SamplingParams | ResolvedSamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    stop_token_ids: set[int] | None = None,
) -> SamplingRow:
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    return SamplingRow(
        params=params.resolve() if isinstance(params, SamplingParams) else params,
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        stop_token_ids=stop_token_ids or set(),
    )


def _meta(rows: list[SamplingRow], vocab_size: int) -> SamplingMetadata:
    return SamplingMetadata.from_rows(rows, vocab_size, sampling_staging(len(rows), CPU))


def _kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(row > NEG_INF).flatten().tolist()) for row in logits]


# Log-probabilities of exact binary fractions: p = [1/2, 1/4, 1/8, 1/16, 1/16].
DYADIC = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625]).log()


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    meta = _meta(rows, 50)
    assert meta.all_greedy and meta.temperature is None and meta.output_counts is None
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    rows = [
        _row(SamplingParams(temperature=0.0)),
        _row(SamplingParams(temperature=1.5)),
        _row(SamplingParams(temperature=0.0)),
        _row(SamplingParams(temperature=1.5, top_k=3)),
    ]
    meta = _meta(rows, 30)
    assert not meta.all_greedy and not meta.all_random
    for seed in range(10):
        out = Sampler()(logits, meta, torch.Generator().manual_seed(seed))
        ids = out.sampled_token_ids
        assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()
        assert ids[3].item() in logits[3].topk(3).indices.tolist()


def test_seeded_rows_are_reproducible_and_batch_independent() -> None:
    vocab = 64
    logits_gen = torch.Generator().manual_seed(2)
    steps = [torch.randn(4, vocab, generator=logits_gen) for _ in range(5)]
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run_alone() -> list[int]:
        row = _row(seeded)
        return [Sampler()(s[2:3], _meta([row], vocab)).sampled_token_ids.item() for s in steps]

    def run_in_batch(engine_seed: int) -> list[int]:
        rows = [
            _row(SamplingParams(temperature=0.8)),
            _row(SamplingParams(temperature=0.0)),
            _row(seeded),
            _row(SamplingParams(temperature=1.2, top_p=0.9)),
        ]
        engine = torch.Generator().manual_seed(engine_seed)
        return [Sampler()(s, _meta(rows, vocab), engine).sampled_token_ids[2].item() for s in steps]

    alone = run_alone()
    assert alone == run_alone()
    assert alone == run_in_batch(0) == run_in_batch(99)
    other_seed = _row(SamplingParams(temperature=1.0, seed=4321))
    different = [
        Sampler()(s[2:3], _meta([other_seed], vocab)).sampled_token_ids.item() for s in steps
    ]
    assert different != alone


def test_unseeded_rows_follow_the_engine_generator() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    meta = _meta([_row(SamplingParams(temperature=1.0)) for _ in range(8)], 100)
    a = Sampler()(logits, meta, torch.Generator().manual_seed(7)).sampled_token_ids
    b = Sampler()(logits, meta, torch.Generator().manual_seed(7)).sampled_token_ids
    c = Sampler()(logits, meta, torch.Generator().manual_seed(8)).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_top_k_mask_is_exact() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    rows = [_row(SamplingParams(top_k=2)), _row(SamplingParams(top_k=0))]
    meta = _meta(rows, 5)
    assert meta.top_p is None and meta.max_top_k == 2
    assert _kept(apply_top_k_top_p(logits, meta)) == [{1, 3}, {0, 1, 2, 3, 4}]
    kept = apply_top_k_top_p(logits, meta)
    assert torch.equal(kept[0, [1, 3]], logits[0, [1, 3]])
    # top_k larger than the vocabulary keeps everything.
    assert (
        _kept(apply_top_k_top_p(logits, _meta([_row(SamplingParams(top_k=99))] * 2, 5)))
        == [{0, 1, 2, 3, 4}] * 2
    )


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.4, {0}), (0.5, {0}), (0.75, {0, 1}), (0.76, {0, 1, 2}), (0.875, {0, 1, 2}), (1.0, None)],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p: float, expected: set[int] | None) -> None:
    logits = DYADIC[None, :].clone()
    out = apply_top_k_top_p(logits, _meta([_row(SamplingParams(top_p=top_p))], 5))
    assert _kept(out) == [expected or {0, 1, 2, 3, 4}]


def test_top_p_renormalizes_after_top_k() -> None:
    # After top-k=2 the probabilities are [2/3, 1/3]: top_p=0.6 keeps only the first token.
    logits = DYADIC[None, :].clone()
    meta = _meta([_row(SamplingParams(top_k=2, top_p=0.6))], 5)
    assert _kept(apply_top_k_top_p(logits, meta)) == [{0}]
    meta = _meta([_row(SamplingParams(top_k=3, top_p=0.7))], 5)
    assert _kept(apply_top_k_top_p(logits, meta)) == [{0, 1}]


def test_top_p_always_keeps_the_top_token() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 10.0]])
    meta = _meta([_row(SamplingParams(top_p=1e-6))], 4)
    assert _kept(apply_top_k_top_p(logits, meta)) == [{3}]


def test_min_p_mask_is_exact() -> None:
    probs = DYADIC[None, :].exp().repeat(2, 1)
    meta = _meta([_row(SamplingParams(min_p=0.25)), _row(SamplingParams(min_p=0.0))], 5)
    assert meta.min_p is not None
    # Threshold 0.25 * 0.5 = 0.125 keeps tokens with p >= 0.125.
    kept = apply_min_p(probs, meta.min_p)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in kept] == [{0, 1, 2}, {0, 1, 2, 3, 4}]
    assert torch.equal(kept[0, :3], probs[0, :3])


def test_top_k_candidates_give_the_same_top_p_mask_as_a_full_sort() -> None:
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(6, 200, generator=gen) * 3
    params = [
        SamplingParams(top_k=40, top_p=0.5),
        SamplingParams(top_k=5, top_p=0.99),
        SamplingParams(top_k=120, top_p=0.9),
        SamplingParams(top_k=0),
        SamplingParams(top_k=7),
        SamplingParams(top_k=1, top_p=0.3),
    ]
    meta = _meta([_row(p) for p in params], 200)
    assert meta.top_k_covers_top_p and meta.max_top_k == 120
    fast = apply_top_k_top_p(logits, meta)
    # Batch-invariant samplers sort whole rows: a width the other rows set never enters.
    assert torch.equal(apply_top_k_top_p(logits, meta, whole_rows=True), fast)
    meta.top_k_covers_top_p = False
    full = apply_top_k_top_p(logits, meta)
    assert torch.equal(fast, full)
    kept = _kept(fast)
    assert kept[3] == set(range(200)) and len(kept[4]) == 7 and len(kept[5]) == 1
    assert 1 < len(kept[0]) < 40
    # A top-p row without top-k needs the full sort.
    assert not _meta(
        [_row(p) for p in [*params, SamplingParams(top_p=0.5)]], 200
    ).top_k_covers_top_p


def _reference_top_p(probs: list[float], top_p: float) -> set[int]:
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            return kept
    return kept


def test_only_allowed_tokens_are_ever_sampled() -> None:
    vocab, draws = 10, 500
    logits = torch.linspace(0.0, 2.0, vocab)
    probs = torch.softmax(logits, dim=-1).tolist()
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.3), SamplingParams(min_p=0.5)]
    expected = [
        {7, 8, 9},
        _reference_top_p(probs, 0.3),
        {i for i, p in enumerate(probs) if p >= 0.5 * max(probs)},
    ]
    assert all(len(e) > 1 for e in expected)
    rows = [_row(p) for p in params for _ in range(draws)]
    out = Sampler()(
        logits.repeat(len(rows), 1), _meta(rows, vocab), torch.Generator().manual_seed(5)
    )
    sampled = out.sampled_token_ids.view(len(params), draws)
    assert [set(r.tolist()) for r in sampled] == expected


def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0, -1.0]])
    meta = _meta([_row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1])], 5)
    assert meta.frequency_penalty is None and meta.presence_penalty is None
    out = apply_penalties(logits, meta)
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, 3.0, -1.0]]))


def test_frequency_and_presence_penalties_exact() -> None:
    logits = torch.zeros(2, 4)
    rows = [
        # Prompt tokens never count for frequency/presence.
        _row(SamplingParams(frequency_penalty=0.5), prompt=[3, 3], output=[2, 2, 1]),
        _row(SamplingParams(presence_penalty=0.5), prompt=[3], output=[2, 2, 1]),
    ]
    out = apply_penalties(logits, _meta(rows, 4))
    assert torch.equal(out, torch.tensor([[0.0, -0.5, -1.0, 0.0], [0.0, -0.5, -0.5, 0.0]]))


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    rows = [
        _row(SamplingParams(temperature=0.0, repetition_penalty=1.1), prompt=[0]),
        _row(SamplingParams(temperature=0.0, frequency_penalty=0.6), output=[0, 0]),
        _row(SamplingParams(temperature=0.0), output=[0, 0]),
    ]
    assert Sampler()(logits, _meta(rows, 3)).sampled_token_ids.tolist() == [1, 1, 0]


def test_min_tokens_masks_stop_ids() -> None:
    eos, stop = 4, 2
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0, 9.0]] * 3)
    params = SamplingParams(temperature=0.0, min_tokens=2)
    rows = [
        _row(params, output=[], stop_token_ids={eos, stop, 999}),
        _row(params, output=[1], stop_token_ids={eos}),
        _row(params, output=[1, 1], stop_token_ids={eos, stop}),
    ]
    meta = _meta(rows, 5)
    assert sorted(zip(meta.banned_rows.tolist(), meta.banned_token_ids.tolist())) == [
        (0, 2),
        (0, 4),
        (1, 4),
    ]
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [1, 2, 4]


def test_logprobs_come_from_raw_logits() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 40, generator=gen)
    rows = [
        _row(SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5), prompt=[1, 2]),
        _row(SamplingParams(temperature=0.0, logprobs=0)),
        _row(SamplingParams(temperature=1.0)),
    ]
    meta = _meta(rows, 40)
    assert meta.max_num_logprobs == 3
    out = Sampler()(logits, meta, gen)
    assert out.logprob_token_ids is not None and out.logprobs is not None
    assert out.sampled_ranks is not None
    assert out.logprob_token_ids.shape == out.logprobs.shape == (3, 4)
    reference = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], reference.gather(1, sampled[:, None])[:, 0])
    top = reference.topk(3, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    for i in range(3):
        order = reference[i].argsort(descending=True).tolist()
        assert out.sampled_ranks[i].item() == order.index(sampled[i].item()) + 1
    assert out.sampled_ranks[1].item() == 1

    ids, logprobs = out.to_host([3, 0, None])
    assert ids == sampled.tolist()
    assert logprobs is not None and logprobs[2] is None
    assert logprobs[1].token_ids == [ids[1]] and logprobs[1].sampled_rank == 1
    assert logprobs[0].token_ids == [ids[0], *top.indices[0].tolist()]
    assert logprobs[0].logprobs == pytest.approx(out.logprobs[0].tolist())


def test_to_host_without_logprobs() -> None:
    meta = _meta([_row(SamplingParams(temperature=0.0))], 3)
    ids, logprobs = Sampler()(torch.tensor([[0.0, 2.0, 1.0]]), meta).to_host([None])
    assert ids == [1] and logprobs is None


def test_temperature_sampling_matches_softmax() -> None:
    num_draws, temperature = 20_000, 0.7
    logits = torch.tensor([1.0, 0.5, -0.5, 0.2])
    meta = _meta([_row(SamplingParams(temperature=temperature))] * num_draws, 4)
    out = Sampler()(logits.repeat(num_draws, 1), meta, torch.Generator().manual_seed(11))
    freq = torch.bincount(out.sampled_token_ids, minlength=4).float() / num_draws
    expected = torch.softmax(logits / temperature, dim=-1)
    # Standard error is below 0.004 for every token; allow ~4 of them.
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0.0)


def test_masked_tokens_never_win_with_tiny_exponentials() -> None:
    # Even if an exponential draw is 0, a masked (prob 0) token is never chosen.
    logits = torch.tensor([[NEG_INF, 0.0, NEG_INF, NEG_INF]] * 256)
    meta = _meta([_row(SamplingParams(temperature=1.0))] * 256, 4)
    out = Sampler()(logits, meta, torch.Generator().manual_seed(0))
    assert set(out.sampled_token_ids.tolist()) == {1}


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(9))
    before = logits.clone()
    rows = [
        _row(SamplingParams(temperature=0.5, top_p=0.5, repetition_penalty=1.3), prompt=[1]),
        _row(SamplingParams(temperature=0.0, min_tokens=3), stop_token_ids={2}),
    ]
    Sampler()(logits, _meta(rows, 10))
    assert torch.equal(logits, before)


def test_bad_inputs_raise() -> None:
    meta = _meta([_row(SamplingParams())], 5)
    with pytest.raises(ValueError, match="vocab_size=5"):
        Sampler()(torch.zeros(1, 6), meta)
    with pytest.raises(ValueError, match="num_rows=1"):
        Sampler()(torch.zeros(2, 5), meta)
    with pytest.raises(AssertionError, match="output_token_ids"):
        _meta([_row(SamplingParams(presence_penalty=0.1), output=[7])], 5)
    with pytest.raises(ValueError, match="at least one row"):
        _meta([], 5)


def test_bf16_logits_are_sampled_in_float32() -> None:
    logits = torch.tensor([[0.0, 1.0, math.log(3.0)]], dtype=torch.bfloat16)
    meta = _meta([_row(SamplingParams(temperature=0.0, logprobs=1))], 3)
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == [2]
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
        ),
    ],
)
def test_advanced_generator_continues_a_seeded_row(device: str) -> None:
    """A generator seeded and moved past k tokens (a request resumed by a new engine core)
    samples token k+1 as the row's own generator does."""
    vocab, k = 300, 7
    logits_gen = torch.Generator().manual_seed(3)
    steps = [torch.randn(3, vocab, generator=logits_gen).to(device) for _ in range(k + 3)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=99)
    noise = SamplingParams(temperature=1.0)

    def sample(generator: torch.Generator, logits: torch.Tensor) -> int:
        rows = [
            SamplingRow(noise.resolve(), [], [], None, set()),
            SamplingRow(params.resolve(), [], [], generator, set()),
        ]
        meta = SamplingMetadata.from_rows(rows, vocab, sampling_staging(2, torch.device(device)))
        return Sampler()(logits[:2], meta).sampled_token_ids[1].item()

    own = torch.Generator(device=device).manual_seed(99)
    uninterrupted = [sample(own, s) for s in steps]
    resumed = torch.Generator(device=device).manual_seed(99)
    advance_sampling_generator(resumed, k, vocab, torch.device(device))
    assert [sample(resumed, s) for s in steps[k:]] == uninterrupted[k:]


def _constrained_reference(
    logits: torch.Tensor, rows: list[SamplingRow], bitmask: torch.Tensor | None
) -> torch.Tensor:
    """The torch definition of the token constraints, one row and one rule at a time."""
    out = logits.clone()
    if bitmask is not None:
        out = apply_token_bitmask_reference(out, bitmask)
    for i, row in enumerate(rows):
        p = row.params
        if p.allowed_token_ids is not None:
            keep = torch.full_like(out[i], NEG_INF)
            keep[list(p.allowed_token_ids)] = 0.0
            out[i] += keep
        for word in p.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) <= len(row.output_token_ids) and (
                not prefix
                or tuple(row.output_token_ids[len(row.output_token_ids) - len(prefix) :]) == prefix
            ):
                out[i, word[-1]] = NEG_INF
        for token_id, bias in (p.logit_bias or {}).items():
            out[i, token_id] += bias
    return out


def test_token_constraints_match_the_torch_reference() -> None:
    vocab = 70
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3))
    with_words = SamplingParams(temperature=0.0, bad_words=["x"]).resolve(
        bad_words_token_ids=[[7], [1, 2, 9], [3, 2, 11], [4, 5, 6, 12]]
    )
    rows = [
        _row(SamplingParams(temperature=0.0, logit_bias={5: 3.5, 69: -100.0, 0: 0.25})),
        _row(SamplingParams(temperature=0.0, allowed_token_ids=[3, 4, 60])),
        _row(with_words, output=[8, 1, 2]),
        _row(SamplingParams(temperature=0.0)),
        _row(SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3, 40], logit_bias={2: 9.0})),
    ]
    meta = _meta(rows, vocab)
    bitmask = allocate_token_bitmask(5, vocab)
    bitmask[3, 0] = 0b1010  # row 3: tokens 1 and 3 of the first word only
    bitmask[3, 1:] = 0
    bitmask[4, 0] = ~(1 << 2)  # row 4: token 2 forbidden by the grammar
    meta.grammar_bitmask = bitmask
    before = logits.clone()
    got = apply_token_constraints(logits, meta)
    assert torch.equal(logits, before)
    expected = _constrained_reference(logits, rows, bitmask)
    assert torch.equal(got, expected)
    # Row 2's output ends with [1, 2]: token 9 is banned, and 7 always; 11 and 12 are not.
    assert _kept(got)[2] == set(range(vocab)) - {7, 9}
    assert _kept(got)[3] == {1, 3} and _kept(got)[4] == {1, 3, 40}
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == expected.argmax(dim=-1).tolist()


def test_token_constraints_apply_to_random_rows_and_keep_raw_logprobs() -> None:
    vocab = 40
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))
    rows = [
        _row(SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[5, 6], logprobs=2)),
        _row(SamplingParams(temperature=0.7, seed=2, logit_bias={9: 100.0})),
    ]
    for _ in range(5):
        out = Sampler()(logits, _meta(rows, vocab))
        assert out.sampled_token_ids[0].item() in (5, 6)
        assert out.sampled_token_ids[1].item() == 9
    raw = logits.log_softmax(dim=-1)
    assert torch.allclose(out.logprobs[0, 1:], raw[0].topk(2).values)


def test_out_of_vocabulary_token_fields_are_front_end_bugs() -> None:
    # The input processor refuses them (test_input_processor.py); the sampler asserts.
    with pytest.raises(AssertionError, match="the front end checks logit_bias"):
        _meta([_row(SamplingParams(logit_bias={12: 1.0}))], 10)
    with pytest.raises(AssertionError, match="the front end checks allowed_token_ids"):
        _meta([_row(SamplingParams(allowed_token_ids=[3, 10]))], 10)
