from __future__ import annotations

import pytest
import torch

from ferrum.kernels.arrival_counters import arrival_counters
from ferrum.kernels.attention_ref import paged_attention_ref
from ferrum.kernels.fp8_quant import empty_group_rows
from ferrum.kernels.paged_attention import (
    SPLIT_KV_MAX_SPLITS,
    allocate_split_kv_workspace,
    default_num_splits,
    paged_attention,
    paged_attention_split_kv,
    paged_attention_unified,
)
from tests.utils.paged_batches import TOL, free_blocks_below_window, make_batch, reference


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(4, 2, 8), (8, 2, 16)])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_split_kv_matches_single_pass_and_reference(
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    num_splits: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    seq_lens = [1, 37, 100, 16]
    b = make_batch([1] * 4, seq_lens, num_heads, num_kv_heads, 32, block_size, dtype, device)
    ws = allocate_split_kv_workspace(6, num_heads, 32, device, max_splits=8)
    scale = 32**-0.5
    split = _split_kv(b, scale, torch.empty_like(b.query), ws, num_splits)
    single = torch.empty_like(b.query)
    paged_attention_unified(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc, b.seq_lens, 1, scale, single
    )
    torch.testing.assert_close(split, single, **TOL[dtype])
    torch.testing.assert_close(split, reference(b, scale), **TOL[dtype])


def test_dispatch_takes_split_path_for_small_long_decode_batch(device: torch.device) -> None:
    b = make_batch([1, 1], [150, 33], 4, 2, 32, 8, torch.float32, device, seed=3)
    ws = allocate_split_kv_workspace(2, 4, 32, device, max_splits=SPLIT_KV_MAX_SPLITS)
    ws.partial_sum.fill_(float("nan"))
    out = torch.empty_like(b.query)
    paged_attention(
        b.query,
        b.kv_cache,
        b.block_tables,
        b.query_start_loc,
        b.seq_lens,
        1,
        b.max_seq_len,
        0.25,
        out,
        workspace=ws,
    )
    splits = default_num_splits(2, 2, SPLIT_KV_MAX_SPLITS)
    assert splits == SPLIT_KV_MAX_SPLITS
    # Parts of whole 64-key tiles: 150 keys fill 3 parts, 33 keys one; nothing else is written.
    assert not ws.partial_sum[0, :, :3].isnan().any() and ws.partial_sum[0, :, 3:].isnan().all()
    assert not ws.partial_sum[1, :, :1].isnan().any() and ws.partial_sum[1, :, 1:].isnan().all()
    torch.testing.assert_close(out, reference(b, 0.25), **TOL[torch.float32])


@pytest.mark.parametrize(("window", "num_splits"), [(1, 4), (33, 3), (64, 8), (500, 2)])
def test_sliding_window_split_kv_matches_reference(
    window: int, num_splits: int, dtype: torch.dtype, device: torch.device
) -> None:
    b = make_batch([1] * 3, [1, 150, 70], 4, 2, 32, 8, dtype, device, seed=7)
    free_blocks_below_window(b, window, 8)
    ws = allocate_split_kv_workspace(3, 4, 32, device, max_splits=8)
    out = _split_kv(b, 0.2, torch.full_like(b.query, float("nan")), ws, num_splits, window)
    expected = paged_attention_ref(
        b.query, b.kv_cache, b.block_tables, b.query_start_loc_cpu, b.seq_lens_cpu, 0.2, window
    )
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize("window", [None, 33], ids=["full", "window33"])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_fused_reduce_equals_the_separate_reduce(
    window: int | None, num_splits: int, dtype: torch.dtype, device: torch.device
) -> None:
    """The combine inside the split kernel (the last of a request's parts to finish) writes the
    separate kernel's output bit for bit, with parts past a context and requests of one part,
    and leaves every arrival counter at zero for the next launch or graph replay."""
    b = make_batch([1] * 4, [1, 37, 150, 16], 8, 2, 32, 8, dtype, device, seed=11)
    if window:
        free_blocks_below_window(b, window, 8)
    ws = allocate_split_kv_workspace(4, 8, 32, device, max_splits=8)
    nan = torch.full_like(b.query, float("nan"))
    separate = _split_kv(b, 0.2, nan.clone(), ws, num_splits, window, fused_reduce=False)
    for _ in range(2):  # the second launch finds the counters the first left
        fused = _split_kv(b, 0.2, nan.clone(), ws, num_splits, window, fused_reduce=True)
        assert torch.equal(fused, separate)
        assert not arrival_counters(device, 8, "test").any()
    if window is None:  # the window's reference: test_sliding_window_split_kv_matches_reference
        torch.testing.assert_close(fused, reference(b, 0.2), **TOL[dtype])


def test_fused_reduce_quantizes_the_output_rows_as_the_separate_reduce(
    device: torch.device,
) -> None:
    """FP8 o_proj input rows (heads of 128): the same bytes and scales from either combine."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    b = make_batch([1] * 3, [9, 300, 70], 8, 2, 128, 16, dtype, device, seed=5)
    ws = allocate_split_kv_workspace(3, 8, 128, device, max_splits=4)
    got = {}
    for fused in (False, True):
        rows = empty_group_rows(3, 8 * 128, device)
        out = torch.empty_like(b.query)
        paged_attention_split_kv(
            b.query, b.kv_cache, b.block_tables, b.seq_lens, b.max_seq_len, 0.1, out, ws,
            num_splits=4, out_fp8=rows, fused_reduce=fused,
        )  # fmt: skip
        got[fused] = (out, rows.q.view(torch.uint8), rows.scales)
    for separate, fused in zip(got[False], got[True], strict=True):
        assert torch.equal(separate, fused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_reduce_on_the_gpu_under_repeats_and_graph_replays() -> None:
    """Where a request's parts run at once: 24 requests of up to 32 parts, the workspace filled
    with NaN before every launch (a stale or early read would show), 30 eager launches and 30
    CUDA-graph replays, each equal to the separate combine bit for bit."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    seq_lens = torch.randint(1, 3000, (24,), generator=gen).tolist()
    b = make_batch([1] * 24, seq_lens, 8, 2, 128, 16, torch.bfloat16, device, seed=3)
    ws = allocate_split_kv_workspace(24, 8, 128, device, max_splits=32)
    expected = _split_kv(b, 0.1, torch.empty_like(b.query), ws, 32, fused_reduce=False)
    out = torch.empty_like(b.query)

    def launch() -> None:
        for part in (ws.partial_out, ws.partial_max, ws.partial_sum, out):
            part.fill_(float("nan"))
        _split_kv(b, 0.1, out, ws, 32, fused_reduce=True)

    for _ in range(30):
        launch()
        assert torch.equal(out, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(30):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def _split_kv(
    b, scale, out, workspace, num_splits, sliding_window=None, fused_reduce=None
) -> torch.Tensor:
    """The split-KV path on batch `b` with 16-key tiles; returns `out`."""
    paged_attention_split_kv(
        b.query,
        b.kv_cache,
        b.block_tables,
        b.seq_lens,
        b.max_seq_len,
        scale,
        out,
        workspace,
        num_splits=num_splits,
        block_n=16,
        sliding_window=sliding_window,
        fused_reduce=fused_reduce,
    )
    return out
