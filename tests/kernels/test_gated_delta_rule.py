from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from ferrum.kernels.gated_delta_rule_decode import gated_delta_rule_decode
from ferrum.kernels.gated_delta_rule_prefill import gated_delta_rule_prefill
from ferrum.kernels.gated_delta_rule_ref import (
    gated_delta_rule_decode_ref,
    gated_delta_rule_prefill_ref,
    gated_delta_rule_ref,
)

# Half inputs run the chunk's matmuls in tf32 on the GPU (exact fp32 under the interpreter).
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def make_inputs(
    num_tokens: int,
    num_k_heads: int,
    num_v_heads: int,
    k_dim: int,
    v_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> Inputs:
    """q, k and v are strided views into one fused projection, as a model produces them; g is
    a log decay drawn like Qwen3.5's -exp(A_log) * softplus(a + dt_bias)."""
    gen = torch.Generator().manual_seed(seed)
    qk_width, v_width = num_k_heads * k_dim, num_v_heads * v_dim
    fused = torch.randn(num_tokens, 2 * qk_width + v_width + 3, generator=gen)
    fused = fused.to(device, dtype)
    q = fused[:, :qk_width].view(num_tokens, num_k_heads, k_dim)
    k = fused[:, qk_width : 2 * qk_width].view(num_tokens, num_k_heads, k_dim)
    v = fused[:, 2 * qk_width : 2 * qk_width + v_width].view(num_tokens, num_v_heads, v_dim)
    a = torch.randn(num_tokens, num_v_heads, generator=gen)
    g = -torch.rand(num_v_heads, generator=gen) * torch.nn.functional.softplus(a - 1.0)
    beta = torch.rand(num_tokens, num_v_heads, generator=gen)
    return Inputs(q, k, v, g.to(device), beta.to(device, dtype))


def random_pool(
    num_slots: int, shape: tuple[int, ...], device: torch.device, seed: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(num_slots, *shape, generator=gen)).to(device)


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_reference_matches_transformers(use_qk_l2norm: bool) -> None:
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    x = make_inputs(100, 2, 4, 16, 24, torch.float32, torch.device("cpu"), seed=1)
    if not use_qk_l2norm:  # unnormalised keys must stay small for the recurrence to be stable
        x.q, x.k = x.q / 4, x.k / 4
    init = random_pool(1, (4, 16, 24), torch.device("cpu"), seed=2)[0]
    out, final = gated_delta_rule_ref(x.q, x.k, x.v, x.g, x.beta, init, None, use_qk_l2norm)
    # Each key head serves consecutive value heads; older transformers need them repeated.
    group = x.v.shape[1] // x.q.shape[1]
    q, k = (t.repeat_interleave(group, dim=1) for t in (x.q, x.k))
    batched = [t.unsqueeze(0) for t in (q, k, x.v, x.g, x.beta)]
    kwargs = dict(
        initial_state=init[None], output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm
    )
    for fn in (modeling.torch_recurrent_gated_delta_rule, modeling.torch_chunk_gated_delta_rule):
        hf_out, hf_final = fn(*batched, **kwargs)
        torch.testing.assert_close(out, hf_out[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(final, hf_final[0], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    ("num_k_heads", "num_v_heads", "k_dim", "v_dim"), [(2, 4, 32, 16), (1, 1, 20, 40)]
)
def test_decode_matches_reference(
    num_k_heads: int,
    num_v_heads: int,
    k_dim: int,
    v_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    x = make_inputs(5, num_k_heads, num_v_heads, k_dim, v_dim, dtype, device)
    pool = random_pool(7, (num_v_heads, k_dim, v_dim), device, seed=3)
    slot_ids = torch.tensor([4, 0, -1, 6, 2], dtype=torch.int32, device=device)
    expected_pool = pool.clone()
    expected = gated_delta_rule_decode_ref(
        x.q, x.k, x.v, x.g, x.beta, expected_pool, slot_ids, use_qk_l2norm=True
    )
    out = torch.full_like(x.v, float("nan"))
    got = gated_delta_rule_decode(
        x.q, x.k, x.v, x.g, x.beta, pool, slot_ids, use_qk_l2norm=True, out=out, block_v=16
    )
    assert got is out
    assert out[2].eq(0).all()  # padding request
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(pool, expected_pool, **TOL[torch.float32])
    for untouched in (1, 3, 5):
        torch.testing.assert_close(pool[untouched], expected_pool[untouched], atol=0, rtol=0)


def test_decode_writes_the_new_state_to_its_destination_slot(
    dtype: torch.dtype, device: torch.device
) -> None:
    """With dst_slot_ids, request i's state goes to dst_slot_ids[i] (a verify step's scratch
    slot) and its slot keeps the old one; outputs are those of the in-place step."""
    x = make_inputs(4, 2, 4, 16, 16, dtype, device, seed=9)
    pool = random_pool(9, (4, 16, 16), device, seed=10)
    slots = torch.tensor([1, 2, -1, 3], dtype=torch.int32, device=device)
    dst = torch.tensor([5, 2, 7, 8], dtype=torch.int32, device=device)
    in_place = pool.clone()
    expected = gated_delta_rule_decode_ref(
        x.q, x.k, x.v, x.g, x.beta, in_place, slots, use_qk_l2norm=True
    )
    for fn in (gated_delta_rule_decode_ref, gated_delta_rule_decode):
        got_pool = pool.clone()
        out = fn(x.q, x.k, x.v, x.g, x.beta, got_pool, slots, use_qk_l2norm=True, dst_slot_ids=dst)
        torch.testing.assert_close(out, expected, **TOL[dtype])
        for src, to in ((1, 5), (2, 2), (3, 8)):
            torch.testing.assert_close(got_pool[to], in_place[src], **TOL[torch.float32])
        for kept in (0, 1, 3, 4, 6, 7):  # sources keep their state; padding writes nothing
            torch.testing.assert_close(got_pool[kept], pool[kept], atol=0, rtol=0)


def test_decode_step_continues_a_sequence(device: torch.device) -> None:
    # Decoding token by token from a zero slot gives the whole-sequence recurrence.
    x = make_inputs(4, 1, 2, 16, 16, torch.float32, device, seed=4)
    pool = torch.zeros(2, 2, 16, 16, device=device)
    slot = torch.tensor([1], dtype=torch.int32, device=device)
    steps = [
        gated_delta_rule_decode(
            x.q[t : t + 1],
            x.k[t : t + 1],
            x.v[t : t + 1],
            x.g[t : t + 1],
            x.beta[t : t + 1],
            pool,
            slot,
            scale=0.3,
        )
        for t in range(4)
    ]
    out, final = gated_delta_rule_ref(x.q, x.k, x.v, x.g, x.beta, scale=0.3)
    torch.testing.assert_close(torch.cat(steps), out, **TOL[torch.float32])
    torch.testing.assert_close(pool[1], final, **TOL[torch.float32])
    assert pool[0].eq(0).all()


def test_prefill_matches_reference(dtype: torch.dtype, device: torch.device) -> None:
    # Lengths around the 64-token chunk, an empty sequence and a padding sequence; some start
    # from their slot's state, the others from zeros.
    seq_lens = [1, 64, 130, 0, 37, 5]
    slot_ids = [3, 0, 5, 1, 2, -1]
    has_init = [False, True, True, True, False, True]
    cu = [0, *itertools.accumulate(seq_lens)]
    x = make_inputs(cu[-1], 2, 4, 32, 32, dtype, device, seed=5)
    pool = random_pool(6, (4, 32, 32), device, seed=6)
    expected_pool = pool.clone()
    expected = gated_delta_rule_prefill_ref(
        x.q, x.k, x.v, x.g, x.beta, cu, expected_pool, slot_ids, has_init, use_qk_l2norm=True
    )
    out = torch.full_like(x.v, float("nan"))
    gated_delta_rule_prefill(
        x.q,
        x.k,
        x.v,
        x.g,
        x.beta,
        torch.tensor(cu, dtype=torch.int32, device=device),
        pool,
        torch.tensor(slot_ids, dtype=torch.int32, device=device),
        torch.tensor(has_init, device=device),
        use_qk_l2norm=True,
        out=out,
    )
    assert out[cu[5] :].eq(0).all()
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(pool, expected_pool, **TOL[dtype])
    for untouched in (1, 4):  # the empty sequence's slot and an unused one
        torch.testing.assert_close(pool[untouched], expected_pool[untouched], atol=0, rtol=0)


def test_prefill_state_feeds_decode(device: torch.device) -> None:
    # A 70-token prompt in two chunks of the schedule (40 + 30), then a decode step: the same
    # outputs as one pass of the recurrence. Without has_initial_state every slot is read.
    x = make_inputs(71, 1, 2, 16, 32, torch.float32, device, seed=7)
    pool = torch.zeros(1, 2, 16, 32, device=device)
    slot = torch.tensor([0], dtype=torch.int32, device=device)
    outs = []
    for lo, hi in ((0, 40), (40, 70)):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=device)
        part = [t[lo:hi] for t in (x.q, x.k, x.v, x.g, x.beta)]
        outs.append(gated_delta_rule_prefill(*part, cu, pool, slot, use_qk_l2norm=True))
    last = [t[70:] for t in (x.q, x.k, x.v, x.g, x.beta)]
    outs.append(gated_delta_rule_decode(*last, pool, slot, use_qk_l2norm=True))
    expected, final = gated_delta_rule_ref(x.q, x.k, x.v, x.g, x.beta, use_qk_l2norm=True)
    torch.testing.assert_close(torch.cat(outs), expected, **TOL[torch.float32])
    torch.testing.assert_close(pool[0], final, **TOL[torch.float32])


def test_validation_errors() -> None:
    cpu = torch.device("cpu")
    x = make_inputs(3, 2, 4, 16, 16, torch.float32, cpu)
    pool = torch.zeros(4, 4, 16, 16)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    args = dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, state_pool=pool, slot_ids=slots)
    bad = {
        "q": x.q.double(),
        "k": x.k[:, :1],
        "v": x.v.transpose(1, 2),
        "g": x.g[:2],
        "beta": x.beta.t().contiguous().t(),
        "state_pool": pool[:, :, :8],
        "slot_ids": slots.long(),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            gated_delta_rule_decode(**{**args, name: value})
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        q3 = torch.zeros(3, 3, 16)
        gated_delta_rule_decode(**{**args, "q": q3, "k": q3})
    with pytest.raises(ValueError, match="out"):
        gated_delta_rule_decode(**args, out=torch.empty(3, 4, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="block_v"):
        gated_delta_rule_decode(**args, block_v=24)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_delta_rule_prefill(**args, cu_seqlens=cu.long())
    with pytest.raises(ValueError, match="slot_ids"):
        gated_delta_rule_prefill(**args, cu_seqlens=cu)
    with pytest.raises(ValueError, match="has_initial_state"):
        gated_delta_rule_prefill(
            **{**args, "slot_ids": slots[:2]}, cu_seqlens=cu, has_initial_state=torch.ones(2)
        )


def test_prefill_is_stable_for_correlated_keys(device: torch.device) -> None:
    # Near-identical keys, beta near 1 and almost no decay: the chunk's triangular system has
    # entries near 1 and its inverse must be formed without a cancelling series.
    x = make_inputs(128, 1, 1, 16, 16, torch.float32, device, seed=8)
    x.k = (x.k[:1] + 0.05 * x.k).contiguous()
    x.beta = 0.9 + 0.1 * x.beta
    x.g = 0.01 * x.g
    cu = torch.tensor([0, 128], dtype=torch.int32, device=device)
    pool = torch.zeros(1, 1, 16, 16, device=device)
    slot = torch.tensor([0], dtype=torch.int32, device=device)
    out = gated_delta_rule_prefill(x.q, x.k, x.v, x.g, x.beta, cu, pool, slot, use_qk_l2norm=True)
    expected, final = gated_delta_rule_ref(x.q, x.k, x.v, x.g, x.beta, use_qk_l2norm=True)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool[0], final, atol=1e-4, rtol=1e-4)
