"""The LoRA shrink and expand (Triton, and the CPU torch path) against the per-token reference,
over batches mixing adapter slots and tokens without an adapter, on odd shapes."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.lora_expand import lora_expand
from ferrum.kernels.lora_ref import (
    lora_expand_ref,
    lora_expand_torch,
    lora_shrink_ref,
    lora_shrink_torch,
)
from ferrum.kernels.lora_segments import LoRASegments
from ferrum.kernels.lora_shrink import lora_shrink, split_k

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _batch(num_tokens: int, num_slots: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1, num_slots, (num_tokens,), generator=g).to(torch.int32).to(DEVICE)


@pytest.mark.parametrize(
    ("num_tokens", "k", "n", "num_slots"),
    [(1, 40, 8, 1), (7, 72, 24, 3), (37, 96, 16, 4), (300, 80, 16, 2), (5, 700, 24, 3)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shrink_matches_reference(
    num_tokens: int, k: int, n: int, num_slots: int, dtype: torch.dtype
) -> None:
    slots = _batch(num_tokens, num_slots, num_tokens)
    x = torch.randn(num_tokens, k, device=DEVICE).to(dtype)
    lora_a = torch.randn(num_slots, n, k, device=DEVICE).to(dtype)
    expected = lora_shrink_ref(x, lora_a, slots)
    segments = LoRASegments.empty(512, num_slots, DEVICE)
    segments.fill(slots)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    got = lora_shrink(x, lora_a, segments)  # fp32; (5, 700): K in 2 slices summed in order
    assert got.dtype == torch.float32
    used = slots >= 0  # the kernel leaves the rows of tokens without an adapter unwritten
    torch.testing.assert_close(got[used].to(dtype), expected[used], atol=tol, rtol=tol)
    again = lora_shrink(x, lora_a, segments)
    assert torch.equal(again[used], got[used])  # the split's sums in a fixed order
    torch.testing.assert_close(lora_shrink_torch(x, lora_a, slots), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("num_tokens", "k", "n", "num_slots"),
    [(1, 8, 40, 1), (9, 16, 72, 3), (33, 24, 130, 4), (300, 8, 40, 2)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_expand_adds_in_place_on_a_column_slice(
    num_tokens: int, k: int, n: int, num_slots: int, dtype: torch.dtype
) -> None:
    slots = _batch(num_tokens, num_slots, k)
    t = torch.randn(num_tokens, k, device=DEVICE).to(dtype)
    lora_b = torch.randn(num_slots, n, k, device=DEVICE).to(dtype)
    wide = torch.randn(num_tokens, n + 10, device=DEVICE).to(dtype)
    expected = wide.clone()
    lora_expand_ref(t, lora_b, slots, expected[:, 5 : 5 + n])
    segments = LoRASegments.empty(512, num_slots, DEVICE)
    segments.fill(slots)
    got = wide.clone()
    lora_expand(t, lora_b, segments, got[:, 5 : 5 + n])
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    for gather_limit in (0, 1 << 22):  # one GEMM per slot, or B gathered per token
        by_torch = wide.clone()
        lora_expand_torch(t, lora_b, slots, by_torch[:, 5 : 5 + n], gather_limit)
        torch.testing.assert_close(by_torch, expected, atol=tol, rtol=tol)
    untouched = slots.cpu() < 0
    assert torch.equal(got[untouched], wide[untouched])
    from_fp32 = wide.clone()  # the shrink's fp32 output, rounded to B's dtype in the kernel
    lora_expand(t.float(), lora_b, segments, from_fp32[:, 5 : 5 + n])
    torch.testing.assert_close(from_fp32, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("slice_starts", [(0, 40), (0, 64, 80), (0, 5, 70)])
def test_expand_covers_a_merged_layers_shards_in_one_launch(slice_starts) -> None:
    num_tokens, rank, n, num_slots = 11, 8, 96, 3
    slots = _batch(num_tokens, num_slots, 5)
    t = torch.randn(num_tokens, len(slice_starts) * rank, device=DEVICE)
    lora_b = torch.randn(num_slots, n, rank, device=DEVICE)
    y = torch.randn(num_tokens, n, device=DEVICE)
    expected = y.clone()
    bounds = (*slice_starts, n)
    for j in range(len(slice_starts)):
        cols = slice(bounds[j], bounds[j + 1])
        block = t[:, j * rank : (j + 1) * rank]
        lora_expand_ref(block, lora_b[:, cols], slots, expected[:, cols])
    segments = LoRASegments.empty(64, num_slots, DEVICE)
    segments.fill(slots)
    lora_expand(t, lora_b, segments, y, slice_starts)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_segments_group_tokens_by_slot() -> None:
    segments = LoRASegments.empty(8, 3, DEVICE)
    segments.fill(torch.tensor([2, -1, 0, 2, 0], dtype=torch.int32, device=DEVICE))
    assert segments.sorted_tokens[:5].tolist() == [1, 2, 4, 0, 3]
    assert segments.slot_starts.tolist() == [1, 3, 3]
    assert segments.slot_counts.tolist() == [2, 0, 2]


def test_launchers_name_the_bad_argument() -> None:
    segments = LoRASegments.empty(4, 1, DEVICE)
    with pytest.raises(ValueError, match="lora_a"):
        lora_shrink(torch.zeros(2, 8, device=DEVICE), torch.zeros(1, 4, 6, device=DEVICE), segments)
    with pytest.raises(ValueError, match="slice_starts"):
        lora_expand(
            torch.zeros(2, 8, device=DEVICE),
            torch.zeros(1, 8, 4, device=DEVICE),
            segments,
            torch.zeros(2, 8, device=DEVICE),
            (0, 9),
        )
    with pytest.raises(ValueError, match="y: expected shape"):
        lora_expand(
            torch.zeros(2, 4, device=DEVICE),
            torch.zeros(1, 8, 4, device=DEVICE),
            segments,
            torch.zeros(2, 9, device=DEVICE),
        )


def test_token_blocks_skip_empty_slots_and_cover_long_ones() -> None:
    """Slots 1 and 2 hold no token, slot 3 three 16-row blocks: the flat token-block grid maps
    every program to the right (slot, block) whatever the mix."""
    slots = torch.tensor([3] * 40 + [0] * 3 + [-1] * 5, dtype=torch.int32, device=DEVICE)
    slots = slots[torch.randperm(48, generator=torch.Generator().manual_seed(0)).to(DEVICE)]
    x = torch.randn(48, 32, device=DEVICE)
    lora_a = torch.randn(4, 16, 32, device=DEVICE)
    lora_b = torch.randn(4, 24, 16, device=DEVICE)
    segments = LoRASegments.empty(64, 4, DEVICE)
    segments.fill(slots)
    used = slots >= 0
    t = lora_shrink(x, lora_a, segments)
    expected_t = lora_shrink_ref(x, lora_a, slots)
    torch.testing.assert_close(t[used], expected_t[used], atol=1e-4, rtol=1e-4)
    y, expected = torch.zeros(48, 24, device=DEVICE), torch.zeros(48, 24, device=DEVICE)
    lora_expand(expected_t, lora_b, segments, y)
    lora_expand_ref(expected_t, lora_b, slots, expected)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-4)


def test_split_k_fills_the_gpu_without_overdoing_it() -> None:
    """Qwen3-8B's down_proj shrink on a 132-SM GPU: a decode step takes the most slices, a long
    chunk (many token blocks) only enough to fill the SMs twice, a short K none."""
    assert split_k(1, 1, 12288, 132) == 32
    assert split_k(32, 1, 12288, 132) == 9  # 2048 tokens in 64-row blocks
    assert split_k(128, 1, 12288, 132) == 3
    assert split_k(1000, 1, 12288, 132) == 1
    assert split_k(1, 1, 200, 132) == 1
