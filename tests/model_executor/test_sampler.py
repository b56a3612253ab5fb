from __future__ import annotations

import math

import pytest
import torch

from ferrum.model_executor.sampler import (
    Sampler,
    advance_sampling_generator,
    apply_penalties,
    apply_token_constraints,
)
from ferrum.model_executor.sampling_metadata import SamplingMetadata, SamplingRow, sampling_staging
from ferrum.model_executor.token_bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_reference,
)
from ferrum.sampling_params import SamplingParams
from tests.utils.sampling_rows import (
    NEG_INF,
    kept_tokens,
    sampling_meta,
    sampling_row,
)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = [sampling_row(SamplingParams(temperature=0.0)) for _ in range(6)]
    meta = sampling_meta(rows, 50)
    assert meta.all_greedy and meta.temperature is None and meta.output_counts is None
    out = Sampler()(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    rows = [
        sampling_row(SamplingParams(temperature=0.0)),
        sampling_row(SamplingParams(temperature=1.5)),
        sampling_row(SamplingParams(temperature=0.0)),
        sampling_row(SamplingParams(temperature=1.5, top_k=3)),
    ]
    meta = sampling_meta(rows, 30)
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
        row = sampling_row(seeded)
        return [
            Sampler()(s[2:3], sampling_meta([row], vocab)).sampled_token_ids.item() for s in steps
        ]

    def run_in_batch(engine_seed: int) -> list[int]:
        rows = [
            sampling_row(SamplingParams(temperature=0.8)),
            sampling_row(SamplingParams(temperature=0.0)),
            sampling_row(seeded),
            sampling_row(SamplingParams(temperature=1.2, top_p=0.9)),
        ]
        engine = torch.Generator().manual_seed(engine_seed)
        return [
            Sampler()(s, sampling_meta(rows, vocab), engine).sampled_token_ids[2].item()
            for s in steps
        ]

    alone = run_alone()
    assert alone == run_alone()
    assert alone == run_in_batch(0) == run_in_batch(99)
    other_seed = sampling_row(SamplingParams(temperature=1.0, seed=4321))
    different = [
        Sampler()(s[2:3], sampling_meta([other_seed], vocab)).sampled_token_ids.item()
        for s in steps
    ]
    assert different != alone


def test_unseeded_rows_follow_the_engine_generator() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(3))
    meta = sampling_meta([sampling_row(SamplingParams(temperature=1.0)) for _ in range(8)], 100)
    a = Sampler()(logits, meta, torch.Generator().manual_seed(7)).sampled_token_ids
    b = Sampler()(logits, meta, torch.Generator().manual_seed(7)).sampled_token_ids
    c = Sampler()(logits, meta, torch.Generator().manual_seed(8)).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_repetition_penalty_exact() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0, -1.0]])
    meta = sampling_meta(
        [sampling_row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1])], 5
    )
    assert meta.frequency_penalty is None and meta.presence_penalty is None
    out = apply_penalties(logits, meta)
    assert torch.equal(out, torch.tensor([[1.0, -4.0, 1.0, 3.0, -1.0]]))


def test_frequency_and_presence_penalties_exact() -> None:
    logits = torch.zeros(2, 4)
    rows = [
        # Prompt tokens never count for frequency/presence.
        sampling_row(SamplingParams(frequency_penalty=0.5), prompt=[3, 3], output=[2, 2, 1]),
        sampling_row(SamplingParams(presence_penalty=0.5), prompt=[3], output=[2, 2, 1]),
    ]
    out = apply_penalties(logits, sampling_meta(rows, 4))
    assert torch.equal(out, torch.tensor([[0.0, -0.5, -1.0, 0.0], [0.0, -0.5, -0.5, 0.0]]))


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    rows = [
        sampling_row(SamplingParams(temperature=0.0, repetition_penalty=1.1), prompt=[0]),
        sampling_row(SamplingParams(temperature=0.0, frequency_penalty=0.6), output=[0, 0]),
        sampling_row(SamplingParams(temperature=0.0), output=[0, 0]),
    ]
    assert Sampler()(logits, sampling_meta(rows, 3)).sampled_token_ids.tolist() == [1, 1, 0]


def test_min_tokens_masks_stop_ids() -> None:
    eos, stop = 4, 2
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0, 9.0]] * 3)
    params = SamplingParams(temperature=0.0, min_tokens=2)
    rows = [
        sampling_row(params, output=[], stop_token_ids={eos, stop, 999}),
        sampling_row(params, output=[1], stop_token_ids={eos}),
        sampling_row(params, output=[1, 1], stop_token_ids={eos, stop}),
    ]
    meta = sampling_meta(rows, 5)
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
        sampling_row(
            SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5), prompt=[1, 2]
        ),
        sampling_row(SamplingParams(temperature=0.0, logprobs=0)),
        sampling_row(SamplingParams(temperature=1.0)),
    ]
    meta = sampling_meta(rows, 40)
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
    meta = sampling_meta([sampling_row(SamplingParams(temperature=0.0))], 3)
    ids, logprobs = Sampler()(torch.tensor([[0.0, 2.0, 1.0]]), meta).to_host([None])
    assert ids == [1] and logprobs is None


def test_temperature_sampling_matches_softmax() -> None:
    num_draws, temperature = 20_000, 0.7
    logits = torch.tensor([1.0, 0.5, -0.5, 0.2])
    meta = sampling_meta([sampling_row(SamplingParams(temperature=temperature))] * num_draws, 4)
    out = Sampler()(logits.repeat(num_draws, 1), meta, torch.Generator().manual_seed(11))
    freq = torch.bincount(out.sampled_token_ids, minlength=4).float() / num_draws
    expected = torch.softmax(logits / temperature, dim=-1)
    # Standard error is below 0.004 for every token; allow ~4 of them.
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0.0)


def test_masked_tokens_never_win_with_tiny_exponentials() -> None:
    # Even if an exponential draw is 0, a masked (prob 0) token is never chosen.
    logits = torch.tensor([[NEG_INF, 0.0, NEG_INF, NEG_INF]] * 256)
    meta = sampling_meta([sampling_row(SamplingParams(temperature=1.0))] * 256, 4)
    out = Sampler()(logits, meta, torch.Generator().manual_seed(0))
    assert set(out.sampled_token_ids.tolist()) == {1}


def test_input_logits_are_not_modified() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(9))
    before = logits.clone()
    rows = [
        sampling_row(
            SamplingParams(temperature=0.5, top_p=0.5, repetition_penalty=1.3), prompt=[1]
        ),
        sampling_row(SamplingParams(temperature=0.0, min_tokens=3), stop_token_ids={2}),
    ]
    Sampler()(logits, sampling_meta(rows, 10))
    assert torch.equal(logits, before)


def test_bad_inputs_raise() -> None:
    meta = sampling_meta([sampling_row(SamplingParams())], 5)
    with pytest.raises(ValueError, match="vocab_size=5"):
        Sampler()(torch.zeros(1, 6), meta)
    with pytest.raises(ValueError, match="num_rows=1"):
        Sampler()(torch.zeros(2, 5), meta)
    with pytest.raises(AssertionError, match="output_token_ids"):
        sampling_meta([sampling_row(SamplingParams(presence_penalty=0.1), output=[7])], 5)
    with pytest.raises(ValueError, match="at least one row"):
        sampling_meta([], 5)


def test_bf16_logits_are_sampled_in_float32() -> None:
    logits = torch.tensor([[0.0, 1.0, math.log(3.0)]], dtype=torch.bfloat16)
    meta = sampling_meta([sampling_row(SamplingParams(temperature=0.0, logprobs=1))], 3)
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
        sampling_row(SamplingParams(temperature=0.0, logit_bias={5: 3.5, 69: -100.0, 0: 0.25})),
        sampling_row(SamplingParams(temperature=0.0, allowed_token_ids=[3, 4, 60])),
        sampling_row(with_words, output=[8, 1, 2]),
        sampling_row(SamplingParams(temperature=0.0)),
        sampling_row(
            SamplingParams(temperature=0.0, allowed_token_ids=[1, 2, 3, 40], logit_bias={2: 9.0})
        ),
    ]
    meta = sampling_meta(rows, vocab)
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
    assert kept_tokens(got)[2] == set(range(vocab)) - {7, 9}
    assert kept_tokens(got)[3] == {1, 3} and kept_tokens(got)[4] == {1, 3, 40}
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids.tolist() == expected.argmax(dim=-1).tolist()


def test_token_constraints_apply_to_random_rows_and_keep_raw_logprobs() -> None:
    vocab = 40
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))
    rows = [
        sampling_row(SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[5, 6], logprobs=2)),
        sampling_row(SamplingParams(temperature=0.7, seed=2, logit_bias={9: 100.0})),
    ]
    for _ in range(5):
        out = Sampler()(logits, sampling_meta(rows, vocab))
        assert out.sampled_token_ids[0].item() in (5, 6)
        assert out.sampled_token_ids[1].item() == 9
    raw = logits.log_softmax(dim=-1)
    assert torch.allclose(out.logprobs[0, 1:], raw[0].topk(2).values)


def test_out_of_vocabulary_token_fields_are_front_end_bugs() -> None:
    # The input processor refuses them (test_input_processor.py); the sampler asserts.
    with pytest.raises(AssertionError, match="the front end checks logit_bias"):
        sampling_meta([sampling_row(SamplingParams(logit_bias={12: 1.0}))], 10)
    with pytest.raises(AssertionError, match="the front end checks allowed_token_ids"):
        sampling_meta([sampling_row(SamplingParams(allowed_token_ids=[3, 10]))], 10)
