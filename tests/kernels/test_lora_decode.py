"""The fused LoRA kernel of small decode steps (kernels/lora_decode.py) against the per-token
reference of the two-kernel path: merged layers whose shards start inside a column block, tokens
without an adapter, ranks that are not powers of two, K past one tile; and its argument checks."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.lora_decode import BLOCK_N, lora_decode
from ferrum.kernels.lora_ref import lora_expand_ref, lora_shrink_ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(x, lora_a, lora_b, slots, y, starts) -> torch.Tensor:  # noqa: ANN001
    """Shard by shard: the shrink's product rounded to the dtype, then the expand."""
    rank, bounds = lora_b.shape[2], (*starts, y.shape[1])
    out = y.clone()
    for j in range(len(starts)):
        t = lora_shrink_ref(x, lora_a[:, j * rank : (j + 1) * rank], slots)
        cols = slice(bounds[j], bounds[j + 1])
        part = out[:, cols].clone()
        lora_expand_ref(t, lora_b[:, cols].contiguous(), slots, part)
        out[:, cols] = part
    return out


@pytest.mark.parametrize(
    ("slots", "k", "starts", "n", "rank"),
    [
        ([0], 40, (0,), 24, 8),
        ([2, -1, 0, 2], 300, (0, 200, 260), 300, 16),  # shards start inside a 256-column block
        ([1, 1], 72, (0, BLOCK_N + 8), 2 * BLOCK_N + 40, 12),  # rank 12: padded to 16, masked
        ([-1, -1, -1], 64, (0,), 64, 16),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_two_kernel_reference(
    slots: list[int], k: int, starts: tuple[int, ...], n: int, rank: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(len(slots) * k)
    num_slots, num_tokens = 3, len(slots)
    x = torch.randn(num_tokens, k, generator=g).to(DEVICE, dtype)
    lora_a = (torch.randn(num_slots, len(starts) * rank, k, generator=g) / k**0.5).to(DEVICE, dtype)
    lora_b = torch.randn(num_slots, n, rank, generator=g).to(DEVICE, dtype)
    y = torch.randn(num_tokens, n, generator=g).to(DEVICE, dtype)
    # The slot map is a longer buffer than the step (as `LoRABatch.token_slots`).
    token_slots = torch.tensor([*slots, 0, 1], dtype=torch.int32, device=DEVICE)
    expected = reference(x, lora_a, lora_b, token_slots[:num_tokens], y, starts)
    lora_decode(x, lora_a, lora_b, token_slots, y, starts)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, expected, atol=tol, rtol=tol)


def test_names_the_bad_argument() -> None:
    x, y = torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 16, device=DEVICE)
    a, b = torch.zeros(1, 8, 8, device=DEVICE), torch.zeros(1, 16, 4, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="lora_a"):
        lora_decode(x, a, b, slots, y)  # one shard of rank 4 needs 4 rows of A
    a = torch.zeros(1, 8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="slice_starts"):
        lora_decode(x, a, b, slots, y, (0, 20))
    with pytest.raises(ValueError, match="token_slots"):
        lora_decode(x, torch.zeros(1, 4, 8, device=DEVICE), b, slots[:1], y)
    with pytest.raises(ValueError, match="one float dtype"):
        lora_decode(x.half(), torch.zeros(1, 4, 8, device=DEVICE), b, slots, y)
