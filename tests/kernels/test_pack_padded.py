"""The Triton copies into SDPA's padded token-major buffer (`kernels/pack_padded.py`) against
the torch code in `sdpa_prefill.py` that is their reference."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.sdpa_prefill import pack_padded, pack_padded_from_cache, padded_length


@pytest.mark.parametrize("head_dim", [32, 24])
def test_the_pack_kernel_writes_rows_then_zeros(device, head_dim) -> None:
    """Strided views of a packed projection (3 query heads, 1 KV head), 37 rows padded to 40:
    the Triton kernel (interpreted on the CPU) copies the rows and zeros the padding rows (which
    held NaN); on the CPU torch's copies in `pack_padded` write the same."""
    from ferrum.kernels.pack_padded import pack_padded_rows

    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(45, 5 * head_dim, generator=gen).to(device)
    q, k, v = qkv.split([3 * head_dim, head_dim, head_dim], dim=-1)
    views = q.view(45, 3, head_dim)[:37], k.view(45, 1, head_dim)[:37], v.view(45, 1, head_dim)[:37]
    packed = torch.full((padded_length(37), 5, head_dim), float("nan"), device=device)
    pack_padded_rows(packed, *views)
    expected = torch.zeros(40, 5, head_dim, device=device)
    expected[:37] = torch.cat(views, dim=1)
    torch.testing.assert_close(packed, expected, atol=0, rtol=0)
    copies = pack_padded(*(x.cpu() for x in views))
    for part, reference in zip(copies, expected.cpu().split([3, 1, 1], dim=1)):
        torch.testing.assert_close(part, reference, atol=0, rtol=0)


@pytest.mark.parametrize("head_dim", [32, 24])
def test_the_cache_pack_kernel_writes_the_chunk_and_the_context(device, head_dim) -> None:
    """A 45-token context (a 27-token cached prefix) in 16-token blocks out of order, padded to
    48 rows: the Triton kernel (interpreted on the CPU) writes what `pack_padded_from_cache`'s
    torch gather writes, over a NaN-filled buffer."""
    from ferrum.kernels.pack_padded import pack_padded_rows_from_cache

    gen = torch.Generator().manual_seed(head_dim)
    cache = torch.randn(2, 6, 16, 2, head_dim, generator=gen).to(device)
    table = torch.tensor([4, 1, 5, 0, 0], dtype=torch.int32, device=device)
    query = torch.randn(30, 6 * head_dim, generator=gen).to(device)[:18, : 3 * head_dim]
    query = query.view(18, 3, head_dim)  # strided rows, as the projections hand them over
    packed = torch.full((padded_length(45), 7, head_dim), float("nan"), device=device)
    pack_padded_rows_from_cache(packed, query, cache, table, 27)
    expected = torch.cat(pack_padded_from_cache(*(x.cpu() for x in (query, cache, table)), 27), 1)
    assert packed.shape == expected.shape == (48, 7, head_dim)
    torch.testing.assert_close(packed.cpu(), expected, atol=0, rtol=0)
    # The reference itself: the chunk's queries after zero rows, the keys of block 5's slot 3.
    assert torch.equal(expected[27:45, :3], query.cpu()) and not expected[:27, :3].any()
    assert torch.equal(expected[35, 3:5], cache[0, 5, 3].cpu()) and not expected[45:].any()
