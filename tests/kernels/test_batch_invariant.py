"""The batch-invariant kernels give a row the same bits in every batch composition: alone, among
others, at another position, in a prompt chunk or as a decode (bitwise, not a tolerance), and
stay within the usual tolerance of the references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferrum.kernels.batch_invariant import MOE_CONFIG, batch_invariant_kernels
from ferrum.kernels.batch_invariant_matmul import invariant_linear
from ferrum.kernels.fused_moe import fused_moe
from ferrum.kernels.fused_moe_ref import fused_moe_ref
from ferrum.kernels.interface import Kernels, torch_kernels, triton_kernels
from tests.utils.paged_batches import TOL, free_blocks_below_window, make_batch, reference

# Row subsets of a 37-row batch: alone, a decode-sized batch, reversed, every third.
SUBSETS = [[5], [0], [36], [3, 4, 5, 6, 7], list(range(36, -1, -1)), list(range(0, 37, 3))]


def rows_of_subsets(linear, x: torch.Tensor, *args: object) -> None:  # noqa: ANN001
    full = linear(x, *args)
    for subset in SUBSETS:
        got = linear(x[subset], *args)
        assert torch.equal(got, full[subset]), f"rows {subset[:6]}... differ from the full batch"


@pytest.mark.parametrize(("n", "k"), [(96, 80), (40, 128)])
def test_invariant_linear_rows_do_not_depend_on_the_batch(
    n: int, k: int, dtype: torch.dtype, device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(37, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype)
    rows_of_subsets(invariant_linear, x, w, bias)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(invariant_linear(x, w, bias), F.linear(x, w, bias), **tol)
    assert invariant_linear(x[:0], w).shape == (0, n)


def test_torch_path_linear_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 200, generator=gen), torch.randn(300, 200, generator=gen)
    linear = batch_invariant_kernels(torch_kernels()).dense_linear
    rows_of_subsets(linear, x, w)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-4, rtol=1e-4)


def invariant_attention(kernels: Kernels):  # noqa: ANN201
    def attend(b, scale: float, window: int | None = None) -> torch.Tensor:  # noqa: ANN001
        out = torch.full_like(b.query, float("nan"))
        return batch_invariant_kernels(kernels).paged_attention(
            b.query, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, b.max_query_len,
            b.max_seq_len, scale, out, None, window,
        )  # fmt: skip

    return attend


unified, torch_path = invariant_attention(triton_kernels()), invariant_attention(torch_kernels())


def as_decodes(b, chunk_start: int, q_len: int, seq_len: int):  # noqa: ANN001, ANN201
    """The chunk's tokens [chunk_start, +q_len) of request 0 (context seq_len) as q_len decodes,
    each over its own prefix of the same cache."""
    positions = range(seq_len - q_len, seq_len)
    query = b.query[chunk_start : chunk_start + q_len]
    tables = b.block_tables[:1].repeat(q_len, 1)
    device = b.query.device
    starts = torch.arange(q_len + 1, dtype=torch.int32, device=device)
    lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=device)
    return type(b)(
        query.contiguous(), b.kv_cache, tables, starts, lens, list(range(q_len + 1)),
        [p + 1 for p in positions], 1, seq_len,
    )  # fmt: skip


@pytest.mark.parametrize("window", [None, 21])
@pytest.mark.parametrize("attention", [unified, torch_path], ids=["triton", "torch"])
def test_attention_of_a_prompt_chunk_equals_its_decodes(
    attention,
    window: int | None,
    device: torch.device,  # noqa: ANN001
) -> None:
    # Request 0: a 13-token chunk over 32 cached tokens; beside it a decode and a 7-token chunk.
    if attention is torch_path and device.type == "cuda":
        pytest.skip("the torch path is the CPU's")
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 8
    dtype = torch.float32
    b = make_batch([13, 1, 7], [45, 30, 19], heads, kv_heads, head_dim, block_size, dtype, device)
    if window is not None:
        free_blocks_below_window(b, window, block_size)
    scale = head_dim**-0.5
    mixed = attention(b, scale, window)
    if window is None:
        torch.testing.assert_close(mixed, reference(b, scale), **TOL[dtype])
    decodes = attention(as_decodes(b, 0, 13, 45), scale, window)
    assert torch.equal(decodes, mixed[:13])
    starts, lens = b.query_start_loc[:2].clone(), b.seq_lens[:1].clone()
    alone = type(b)(
        b.query[:13].clone(), b.kv_cache, b.block_tables[:1], starts, lens, [0, 13], [45], 13, 45
    )
    assert torch.equal(attention(alone, scale, window), mixed[:13])


def test_fused_moe_rows_do_not_depend_on_the_batch(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    tokens, hidden, inter, experts, top_k = 37, 64, 32, 8, 2
    x = torch.randn(tokens, hidden, generator=gen).to(device)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / 8).to(device)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / 6).to(device)
    weights = torch.rand(tokens, top_k, generator=gen).to(device)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(device)

    def moe(rows: list[int]) -> torch.Tensor:
        return fused_moe(x[rows], w13, w2, weights[rows], ids[rows], config=MOE_CONFIG)

    full = moe(list(range(tokens)))
    for subset in SUBSETS:
        assert torch.equal(moe(subset), full[subset])
    expected = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=1e-4)
    torch_moe = batch_invariant_kernels(torch_kernels()).fused_moe
    if device.type == "cpu":
        torch_full = torch_moe(x, w13, w2, weights, ids)
        for subset in SUBSETS:
            assert torch.equal(torch_moe(x[subset], w13, w2, weights[subset], ids[subset]),
                               torch_full[subset])  # fmt: skip
        torch.testing.assert_close(torch_full, expected, atol=1e-5, rtol=1e-5)
