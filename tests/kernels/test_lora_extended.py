"""The LoRA expand after an extended weight's GEMM (Triton, and its torch form) against the
obvious definition: base product plus each token's shrink and expand by the per-token reference,
over batches mixing slots and tokens without an adapter, merged layers' shards, ranks below the
dot's 16, and long chunks."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.lora_expand import lora_expand_extended
from ferrum.kernels.lora_ref import lora_expand_extended_torch, lora_expand_ref, lora_shrink_ref
from ferrum.kernels.lora_segments import LoRASegments

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _expected(x, weight, lora_a, lora_b, slots, slice_starts):  # noqa: ANN001, ANN202
    """y = x W^T + per shard j: (x A_j^T) B_j^T for each token's slot."""
    rank, n = lora_b.shape[2], weight.shape[0]
    y = x @ weight.t()
    t = lora_shrink_ref(x, lora_a, slots)
    bounds = (*slice_starts, n)
    for j in range(len(slice_starts)):
        cols = slice(bounds[j], bounds[j + 1])
        lora_expand_ref(t[:, j * rank : (j + 1) * rank], lora_b[:, cols], slots, y[:, cols])
    return y


@pytest.mark.parametrize(
    ("num_tokens", "n", "rank", "num_slots", "slice_starts"),
    [
        (1, 40, 8, 1, (0,)),
        (9, 96, 16, 3, (0, 64, 80)),
        (33, 130, 4, 4, (0, 5)),
        (300, 72, 16, 2, (0, 40)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extended_gemm_then_expand_matches_shrink_and_expand(
    num_tokens: int,
    n: int,
    rank: int,
    num_slots: int,
    slice_starts: tuple[int, ...],
    dtype: torch.dtype,
) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    k, num_slices = 48, len(slice_starts)
    slots = torch.randint(-1, num_slots, (num_tokens + 3,), generator=g).to(torch.int32)
    x = torch.randn(num_tokens, k, generator=g)
    weight = torch.randn(n, k, generator=g) / 4
    lora_a = torch.randn(num_slots, num_slices * rank, k, generator=g) / 4
    lora_b = torch.randn(num_slots, n, rank, generator=g) / 4
    x, weight, lora_a, lora_b = (v.to(DEVICE, dtype) for v in (x, weight, lora_a, lora_b))
    slots = slots.to(DEVICE)
    expected = _expected(x.float(), weight.float(), lora_a.float(), lora_b.float(),
                         slots[:num_tokens], slice_starts)  # fmt: skip
    extended = torch.cat([weight, lora_a.reshape(-1, k)])
    y_ext = x @ extended.t()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    segments = LoRASegments.empty(512, num_slots, DEVICE)
    segments.fill(slots[:num_tokens])
    got = lora_expand_extended(y_ext, n, lora_b, segments, slice_starts)
    assert got.shape == (num_tokens, n) and got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
    by_torch = lora_expand_extended_torch(y_ext, n, lora_b, slots, slice_starts)
    torch.testing.assert_close(by_torch.float(), expected, atol=tol, rtol=tol)
    no_adapter = (slots[:num_tokens] < 0).cpu()
    assert torch.equal(got[no_adapter].cpu(), y_ext[:, :n][no_adapter].cpu())  # copied as is


def test_launcher_names_the_bad_argument() -> None:
    lora_b = torch.zeros(2, 8, 4, device=DEVICE)
    slots = LoRASegments.empty(4, 2, DEVICE)
    with pytest.raises(ValueError, match="y_ext"):
        lora_expand_extended(torch.zeros(3, 8 + 7, device=DEVICE), 8, lora_b, slots)
    with pytest.raises(ValueError, match="lora_b"):
        lora_expand_extended(torch.zeros(3, 16, device=DEVICE), 9, lora_b, slots)
    with pytest.raises(ValueError, match="more than the segments"):
        lora_expand_extended(torch.zeros(5, 8 + 8, device=DEVICE), 8, lora_b, slots)
    with pytest.raises(ValueError, match="slice_starts"):
        lora_expand_extended(torch.zeros(3, 8 + 16, device=DEVICE), 8, lora_b, slots, (0, 9))


def test_fresh_segments_copy_every_row() -> None:
    """Before any step with an adapter regroups, a captured graph replays with the segments as
    made: they must read as a batch without adapters, so every row of the output is written (an
    unwritten row would be whatever memory the output took)."""
    num_tokens, n, rank = 20, 24, 4
    segments = LoRASegments.empty(32, 2, DEVICE)
    y_ext = torch.randn(num_tokens, n + 2 * rank, device=DEVICE)
    lora_b = torch.randn(2, n, rank, device=DEVICE)
    got = lora_expand_extended(y_ext, n, lora_b, segments)
    assert torch.equal(got, y_ext[:, :n])
