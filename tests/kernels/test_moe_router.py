"""Triton MoE router against `select_experts`, the torch reference."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.fused_moe_ref import select_experts
from ferrum.kernels.moe_router import moe_router


def distinct_logits(num_tokens: int, num_experts: int, device, seed: int = 0) -> torch.Tensor:
    """Per row a permutation of distinct multiples of 1/16, exact in fp16 and bf16, so that
    top-k has no ties and the reference's order is unique."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)]
    logits = (torch.stack(rows).float() - num_experts / 2) / 16
    return logits.reshape(num_tokens, num_experts).to(device)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"),
    [(1, 128, 8), (5, 5, 2), (3, 6, 6), (4, 7, 1)],
)
@pytest.mark.parametrize("renormalize", [False, True])
def test_matches_select_experts(num_tokens, num_experts, top_k, renormalize, dtype, device):
    logits = distinct_logits(num_tokens, num_experts, device, seed=num_experts).to(dtype)
    weights, ids = moe_router(logits, top_k, renormalize)
    expected_weights, expected_ids = select_experts(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (num_tokens, top_k)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(1), torch.ones(num_tokens, device=device))


def test_ties_take_the_lowest_expert_first(device) -> None:
    logits = torch.zeros(2, 6, device=device)
    logits[:, 3] = 1.0
    weights, ids = moe_router(logits, 4, False)
    assert ids.tolist() == [[3, 0, 1, 2]] * 2
    torch.testing.assert_close(weights[:, 1:], weights[:, 1:2].expand(2, 3))


def test_a_nan_row_still_routes_to_valid_distinct_experts(device) -> None:
    logits = distinct_logits(2, 6, device, seed=3)
    logits[1, 4] = float("nan")
    weights, ids = moe_router(logits, 3, True)
    expected_weights, expected_ids = select_experts(logits[:1], 3, True)
    assert ids[0].tolist() == expected_ids[0].tolist()
    torch.testing.assert_close(weights[:1], expected_weights)
    # The NaN row: the first experts in index order, NaN weights (never an id out of range).
    assert ids[1].tolist() == [0, 1, 2] and weights[1].isnan().all()


def test_strided_logits_and_no_tokens(device) -> None:
    wide = distinct_logits(3, 10, device, seed=1)
    logits = wide[:, ::2]  # stride(1) == 2
    weights, ids = moe_router(logits, 2, True)
    expected_weights, expected_ids = select_experts(logits, 2, True)
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights)
    weights, ids = moe_router(logits[:0], 2, True)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize(
    ("logits", "top_k", "match"),
    [
        (torch.zeros(8), 2, "router_logits"),
        (torch.zeros(2, 8, dtype=torch.int32), 2, "router_logits"),
        (torch.zeros(2, 0), 1, "router_logits"),
        (torch.zeros(2, 8), 0, "top_k"),
        (torch.zeros(2, 8), 9, "top_k"),
    ],
)
def test_bad_input(logits, top_k, match) -> None:
    with pytest.raises(ValueError, match=match):
        moe_router(logits, top_k, False)
