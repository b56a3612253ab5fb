"""The sampler's filters: top-k, top-p (after top-k, on candidates or a full sort, or whole
rows for batch invariance) and min-p keep exactly the tokens their definitions keep."""

from __future__ import annotations

import pytest
import torch

from ferrum.model_executor.sampler import Sampler, apply_min_p, apply_top_k_top_p
from ferrum.sampling_params import SamplingParams
from tests.utils.sampling_rows import DYADIC, kept_tokens, sampling_meta, sampling_row


def test_top_k_mask_is_exact() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    rows = [sampling_row(SamplingParams(top_k=2)), sampling_row(SamplingParams(top_k=0))]
    meta = sampling_meta(rows, 5)
    assert meta.top_p is None and meta.max_top_k == 2
    assert kept_tokens(apply_top_k_top_p(logits, meta)) == [{1, 3}, {0, 1, 2, 3, 4}]
    kept = apply_top_k_top_p(logits, meta)
    assert torch.equal(kept[0, [1, 3]], logits[0, [1, 3]])
    # top_k larger than the vocabulary keeps everything.
    assert (
        kept_tokens(
            apply_top_k_top_p(
                logits, sampling_meta([sampling_row(SamplingParams(top_k=99))] * 2, 5)
            )
        )
        == [{0, 1, 2, 3, 4}] * 2
    )


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(0.4, {0}), (0.5, {0}), (0.75, {0, 1}), (0.76, {0, 1, 2}), (0.875, {0, 1, 2}), (1.0, None)],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p: float, expected: set[int] | None) -> None:
    logits = DYADIC[None, :].clone()
    out = apply_top_k_top_p(logits, sampling_meta([sampling_row(SamplingParams(top_p=top_p))], 5))
    assert kept_tokens(out) == [expected or {0, 1, 2, 3, 4}]


def test_top_p_renormalizes_after_top_k() -> None:
    # After top-k=2 the probabilities are [2/3, 1/3]: top_p=0.6 keeps only the first token.
    logits = DYADIC[None, :].clone()
    meta = sampling_meta([sampling_row(SamplingParams(top_k=2, top_p=0.6))], 5)
    assert kept_tokens(apply_top_k_top_p(logits, meta)) == [{0}]
    meta = sampling_meta([sampling_row(SamplingParams(top_k=3, top_p=0.7))], 5)
    assert kept_tokens(apply_top_k_top_p(logits, meta)) == [{0, 1}]


def test_top_p_always_keeps_the_top_token() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 10.0]])
    meta = sampling_meta([sampling_row(SamplingParams(top_p=1e-6))], 4)
    assert kept_tokens(apply_top_k_top_p(logits, meta)) == [{3}]


def test_min_p_mask_is_exact() -> None:
    probs = DYADIC[None, :].exp().repeat(2, 1)
    meta = sampling_meta(
        [sampling_row(SamplingParams(min_p=0.25)), sampling_row(SamplingParams(min_p=0.0))], 5
    )
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
    meta = sampling_meta([sampling_row(p) for p in params], 200)
    assert meta.top_k_covers_top_p and meta.max_top_k == 120
    fast = apply_top_k_top_p(logits, meta)
    # Batch-invariant samplers sort whole rows: a width the other rows set never enters.
    assert torch.equal(apply_top_k_top_p(logits, meta, whole_rows=True), fast)
    meta.top_k_covers_top_p = False
    full = apply_top_k_top_p(logits, meta)
    assert torch.equal(fast, full)
    kept = kept_tokens(fast)
    assert kept[3] == set(range(200)) and len(kept[4]) == 7 and len(kept[5]) == 1
    assert 1 < len(kept[0]) < 40
    # A top-p row without top-k needs the full sort.
    assert not sampling_meta(
        [sampling_row(p) for p in [*params, SamplingParams(top_p=0.5)]], 200
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
    rows = [sampling_row(p) for p in params for _ in range(draws)]
    out = Sampler()(
        logits.repeat(len(rows), 1), sampling_meta(rows, vocab), torch.Generator().manual_seed(5)
    )
    sampled = out.sampled_token_ids.view(len(params), draws)
    assert [set(r.tolist()) for r in sampled] == expected
