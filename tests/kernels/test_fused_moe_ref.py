"""fused_moe_ref against a per-token, per-choice evaluation of the same mixture."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.fused_moe_ref import fused_moe_ref


def naive_moe(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    intermediate = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e].double() @ hidden[t].double()
            act = torch.nn.functional.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ act)
    return out


def random_problem(num_tokens, hidden, intermediate, num_experts, top_k, seed, used=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * 0.2
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) * 0.2
    pool = torch.tensor(used if used is not None else range(num_experts))
    ids = torch.stack(
        [pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(num_tokens)]
    )
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(
    ("num_tokens", "hidden", "intermediate", "num_experts", "top_k"),
    [(1, 8, 4, 2, 1), (7, 24, 10, 5, 2), (33, 40, 12, 9, 3), (5, 16, 6, 4, 4)],
)
def test_matches_naive(num_tokens, hidden, intermediate, num_experts, top_k) -> None:
    problem = random_problem(num_tokens, hidden, intermediate, num_experts, top_k, seed=num_tokens)
    out = fused_moe_ref(*problem)
    assert out.shape == (num_tokens, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_moe(*problem), atol=1e-5, rtol=1e-5)


def test_experts_without_tokens_and_int32_ids() -> None:
    x, w13, w2, weights, ids = random_problem(6, 16, 8, 8, 2, seed=3, used=[1, 6])
    expected = naive_moe(x, w13, w2, weights, ids)
    # Unused experts hold NaN: their weights must never be read.
    unused = [e for e in range(8) if e not in (1, 6)]
    w13[unused] = float("nan")
    w2[unused] = float("nan")
    out = fused_moe_ref(x, w13, w2, weights, ids.to(torch.int32))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_low_precision_keeps_input_dtype() -> None:
    problem = random_problem(9, 32, 16, 4, 2, seed=5)
    x, w13, w2, weights, ids = problem
    out = fused_moe_ref(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), naive_moe(*problem), atol=0.1, rtol=0.05)
