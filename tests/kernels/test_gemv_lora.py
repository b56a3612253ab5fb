"""The one-row GEMV with its LoRA adapter in one launch against the base product plus the
separate shrink/expand reference, for merged layers of 1-3 shards, a row without an adapter,
ranks below the pool's, ragged N and K; its t carries the forward's number, and a later forward's
launch with another input is not given the older t."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.gemv_config import GemvTile
from ferrum.kernels.gemv_lora import gemv_lora, new_t_scratch
from ferrum.kernels.lora_ref import lora_expand_torch, lora_shrink_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float16]


def _reference(x, weight, bias, lora_a, lora_b, slot, starts):  # noqa: ANN001
    b = bias if bias is None else bias.float()
    y = torch.nn.functional.linear(x.float(), weight.float(), b)
    if slot < 0:
        return y
    slots = torch.tensor([slot], dtype=torch.int32, device=x.device)
    t = lora_shrink_torch(x.float(), lora_a.float(), slots).to(lora_b.dtype).float()
    rank, bounds = lora_b.shape[2], (*starts, y.shape[1])
    for j in range(len(starts)):
        cols = slice(bounds[j], bounds[j + 1])
        part = t[:, j * rank : (j + 1) * rank]
        lora_expand_torch(part, lora_b[:, cols].float(), slots, y[:, cols])
    return y


@pytest.mark.parametrize(
    ("k", "shards", "block_n", "block_k"),
    [(96, (24,), 8, 32), (100, (40, 9, 9), 8, 32), (64, (33, 30), 16, 64), (130, (7,), 4, 64)],
)
@pytest.mark.parametrize("slot", [1, 0, -1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_base_plus_shrink_expand(k, shards, block_n, block_k, slot, dtype) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(k + len(shards) + slot)
    n, rank, num_slots = sum(shards), 8, 3
    starts = tuple(sum(shards[:i]) for i in range(len(shards)))
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(n, k, generator=gen) * 0.1).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype) if block_n == 8 else None
    lora_a = (torch.randn(num_slots, len(shards) * rank, k, generator=gen) * 0.1).to(DEVICE, dtype)
    lora_a[:, rank - 3 : rank] = 0  # shard 0's adapter has rank 5: the pool pads with zeros
    lora_b = (torch.randn(num_slots, n, rank, generator=gen) * 0.1).to(DEVICE, dtype)
    slots = torch.tensor([slot, 2], dtype=torch.int32, device=DEVICE)  # the first row's slot
    tile = GemvTile(block_n, block_k)
    scratch, seq = new_t_scratch(weight, tile, len(shards), rank), torch.ones(1, dtype=torch.int32)
    seq = seq.to(DEVICE)
    got = gemv_lora(x, weight, lora_a, lora_b, slots, starts, tile, scratch, seq, bias)
    expected = _reference(x, weight, bias, lora_a, lora_b, slot, starts)
    assert got.dtype == dtype and got.shape == (1, n)
    tol = 2e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
    # Every partial of t is tagged with the forward's number (with an adapter; untouched without).
    assert set((scratch >> 32).flatten().tolist()) == {1 if slot >= 0 else -1}
    seq += 1  # the next forward: another input, whose t the old tags must not pass for current
    other = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    got = gemv_lora(other, weight, lora_a, lora_b, slots, starts, tile, scratch, seq, bias)
    expected = _reference(other, weight, bias, lora_a, lora_b, slot, starts)
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_rejects_mismatched_operands() -> None:
    x, w = torch.zeros(1, 16), torch.zeros(8, 16)
    a, b = torch.zeros(2, 4, 16), torch.zeros(2, 8, 4)
    slots, tile = torch.zeros(1, dtype=torch.int32), GemvTile(8, 16)
    seq, half = torch.ones(1, dtype=torch.int32), torch.float16
    scratch = new_t_scratch(w.half(), tile, 1, 4)
    with pytest.raises(ValueError, match="weight"):
        gemv_lora(x, w, a, b, slots, (0,), tile, scratch, seq)
    x, w, a, b = x.to(half), w.to(half), a.to(half), b.to(half)
    with pytest.raises(ValueError, match="x: "):
        gemv_lora(torch.zeros(2, 16, dtype=half), w, a, b, slots, (0,), tile, scratch, seq)
    with pytest.raises(ValueError, match="slice_starts"):
        gemv_lora(x, w, a, b, slots, (0, 0), tile, scratch, seq)
    with pytest.raises(ValueError, match="lora_a: "):
        gemv_lora(x, w, a, b, slots, (0, 4), tile, scratch, seq)
    with pytest.raises(ValueError, match="dtype"):
        gemv_lora(x, w, a.float(), b, slots, (0,), tile, scratch, seq)
    with pytest.raises(ValueError, match="t_scratch"):
        gemv_lora(x, w, a, b, slots, (0,), tile, scratch[:, :2], seq)
