from __future__ import annotations

import itertools

import pytest
import torch

from ferrum.kernels.causal_conv1d import causal_conv1d_prefill, causal_conv1d_update
from ferrum.kernels.causal_conv1d_ref import (
    causal_conv1d_prefill_ref,
    causal_conv1d_ref,
    causal_conv1d_update_ref,
)

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def _weights(
    dim: int, width: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(dim, width, generator=gen) / width
    bias = 0.1 * torch.randn(dim, generator=gen)
    return weight.to(device, dtype), bias.to(device, dtype)


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device, dtype)


@pytest.mark.parametrize("with_bias", [True, False])
def test_reference_matches_transformers(with_bias: bool) -> None:
    modeling = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    cpu = torch.device("cpu")
    weight, bias = _weights(6, 4, torch.float32, cpu, seed=0)
    bias = bias if with_bias else None
    x = _randn(9, 6, dtype=torch.float32, device=cpu, seed=1)
    # From zeros: transformers' prefill function.
    y, state = causal_conv1d_ref(x, weight, bias, None, "silu")
    hf_y = modeling.causal_conv1d_fn(x.t()[None], weight, bias, activation="silu")
    torch.testing.assert_close(y, hf_y[0].t(), atol=1e-6, rtol=1e-6)
    assert torch.equal(state, x[-3:])
    # From a state: transformers' update, whose state keeps one more (unread) older input.
    prev = _randn(3, 6, dtype=torch.float32, device=cpu, seed=2)
    for seq_len in (1, 2, 5):
        hf_state = torch.cat([torch.full((1, 6), 7.0), prev]).t()[None].clone()
        hf_y = modeling.causal_conv1d_update(x[:seq_len].t()[None], hf_state, weight, bias, "silu")
        y, state = causal_conv1d_ref(x[:seq_len], weight, bias, prev, "silu")
        torch.testing.assert_close(y, hf_y[0].t(), atol=1e-6, rtol=1e-6)
        assert torch.equal(state, hf_state[0, :, 1:].t())


@pytest.mark.parametrize(("dim", "width"), [(200, 4), (24, 2)])
def test_prefill_matches_reference(
    dim: int, width: int, dtype: torch.dtype, device: torch.device
) -> None:
    # Lengths shorter than the state, across token tiles, an empty and a padding sequence.
    seq_lens = [1, 2, 70, 0, 33, 4]
    slot_ids = [5, 0, 2, 1, -1, 3]
    has_init = [True, True, False, True, True, True]
    cu = [0, *itertools.accumulate(seq_lens)]
    weight, bias = _weights(dim, width, dtype, device, seed=3)
    # x is a strided view into a wider projection output.
    x = _randn(cu[-1], dim + 5, dtype=dtype, device=device, seed=4)[:, :dim]
    pool = _randn(6, width - 1, dim, dtype=dtype, device=device, seed=5)
    expected_pool = pool.clone()
    expected = causal_conv1d_prefill_ref(
        x, weight, bias, expected_pool, cu, slot_ids, has_init, "silu"
    )
    out = torch.full_like(x, float("nan"))
    got = causal_conv1d_prefill(
        x,
        weight,
        bias,
        pool,
        torch.tensor(cu, dtype=torch.int32, device=device),
        torch.tensor(slot_ids, dtype=torch.int32, device=device),
        max(seq_lens),
        torch.tensor(has_init, device=device),
        out=out,
    )
    assert got is out
    assert out[cu[4] : cu[5]].eq(0).all()
    torch.testing.assert_close(out, expected, **TOL[dtype])
    # State rows are copies of inputs: exact.
    torch.testing.assert_close(pool, expected_pool, atol=0, rtol=0)


def test_update_matches_reference(dtype: torch.dtype, device: torch.device) -> None:
    weight, bias = _weights(48, 4, dtype, device, seed=6)
    x = _randn(4, 48, dtype=dtype, device=device, seed=7)
    pool = _randn(5, 3, 48, dtype=dtype, device=device, seed=8)
    slot_ids = torch.tensor([3, -1, 0, 4], dtype=torch.int32, device=device)
    expected_pool = pool.clone()
    expected = causal_conv1d_update_ref(x, weight, None, expected_pool, slot_ids, None)
    out = causal_conv1d_update(x, weight, None, pool, slot_ids, activation=None)
    assert out[1].eq(0).all()
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(pool, expected_pool, atol=0, rtol=0)


def test_prefill_then_updates_equal_one_pass(device: torch.device) -> None:
    weight, bias = _weights(16, 4, torch.float32, device, seed=9)
    x = _randn(12, 16, dtype=torch.float32, device=device, seed=10)
    pool = torch.zeros(2, 3, 16, device=device)
    slot = torch.tensor([1], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 9], dtype=torch.int32, device=device)
    no_state = torch.tensor([False], device=device)
    pool[1] = 5.0  # ignored: the sequence starts without a state
    outs = [causal_conv1d_prefill(x[:9], weight, bias, pool, cu, slot, 9, no_state)]
    outs += [causal_conv1d_update(x[t : t + 1], weight, bias, pool, slot) for t in range(9, 12)]
    expected, state = causal_conv1d_ref(x, weight, bias, None, "silu")
    torch.testing.assert_close(torch.cat(outs), expected, **TOL[torch.float32])
    assert torch.equal(pool[1], state) and pool[0].eq(0).all()


def test_validation_errors() -> None:
    weight, bias = _weights(8, 4, torch.float32, torch.device("cpu"), seed=0)
    x = torch.zeros(3, 8)
    pool = torch.zeros(2, 3, 8)
    slots = torch.tensor([0, 1, -1], dtype=torch.int32)
    args = dict(x=x, weight=weight, bias=bias, conv_state_pool=pool, slot_ids=slots)
    bad = {
        "x": x.t(),
        "weight": weight.half(),
        "bias": bias[:4],
        "conv_state_pool": torch.zeros(2, 4, 8),
        "slot_ids": slots.long(),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            causal_conv1d_update(**{**args, name: value})
    with pytest.raises(ValueError, match="width"):
        causal_conv1d_update(**{**args, "weight": torch.zeros(8, 9), "conv_state_pool": pool})
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_update(**args, activation="gelu")
    with pytest.raises(ValueError, match="out"):
        causal_conv1d_update(**args, out=torch.zeros(3, 4))
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seq_len"):
        causal_conv1d_prefill(**{**args, "slot_ids": slots[:2]}, cu_seqlens=cu, max_seq_len=4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_conv1d_prefill(**args, cu_seqlens=cu[None], max_seq_len=2)
