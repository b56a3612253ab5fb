"""The attention layer's split of a step between SDPA and the paged kernels
(`Attention._attend_by_segments`): which layers take SDPA, and mixed steps whose rows equal the
paged reference (SDPA's math backend; the paged kernels interpreted on the CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.nn.attention import SDPBackend

import ferrum.kernels.sdpa_prefill as sdpa_module
from ferrum.kernels.attention_ref import paged_attention_ref
from ferrum.kernels.interface import torch_kernels, triton_kernels
from ferrum.kernels.sdpa_prefill import long_prefill_segments, sdpa_prefill


@pytest.mark.parametrize(
    "window, cache_dtype, kernels, expected",
    [
        (None, torch.bfloat16, True, True),
        (1024, torch.bfloat16, True, False),  # a sliding window keeps the paged kernel
        (None, torch.float8_e4m3fn, True, False),  # so does an FP8 cache
        (None, torch.bfloat16, False, False),  # and the torch reference path
    ],
)
def test_which_layers_take_it(monkeypatch, window, cache_dtype, kernels, expected) -> None:
    """The layer's rule, with the device check passed (this may run without a GPU)."""
    from ferrum.model_executor.layers import attention as attention_module

    monkeypatch.setattr(attention_module, "sdpa_takes", lambda device, dtype, head_dim: True)
    layer = attention_module.Attention(
        4, 16, 2, 0.25, triton_kernels() if kernels else torch_kernels(), sliding_window=window
    )
    layer.bind_kv_cache(torch.zeros(2, 3, 16, 2, 16, dtype=cache_dtype))
    assert layer.takes_sdpa_prefill() is expected
    assert (layer.sdpa_prefill_shape() is not None) is expected


def _paged_reference_kernel(
    query, kv_cache, block_tables, query_start_loc, seq_lens, max_q, max_s, scale, out, *_, **kw
):
    """The paged kernel's contract on the CPU, through the torch reference."""
    assert kw.get("sliding_window") is None
    assert max_q == max(
        int(b - a) for a, b in zip(query_start_loc[:-1], query_start_loc[1:])
    ) and max_s == int(seq_lens.max())
    expected = paged_attention_ref(
        query, kv_cache, block_tables, query_start_loc.tolist(), seq_lens.tolist(), scale
    )
    return out.copy_(expected)


def _mixed_step(device: torch.device, heads: int, kv_heads: int, dim: int):
    """Decodes, long fresh prompts, a long chunk after a short cached prefix, a short later
    chunk, a long chunk after a long prefix and a short first chunk in one step: (query, keys,
    values, cache, tables, starts, seq_lens, metadata, segments)."""
    from types import SimpleNamespace

    block = 16
    # (context length, chunk length) per request, in token order.
    requests = [
        *[(300, 1), (200, 1), (33, 33), (50, 50), (100, 40), (70, 30), (200, 40), (9, 9)],
        *[(45, 45), (260, 1)],
    ]
    gen = torch.Generator().manual_seed(0)
    blocks = [-(-n // block) for n, _ in requests]
    cache = torch.randn(2, sum(blocks) + 1, block, kv_heads, dim, generator=gen)
    # An odd table width (21): slices at most requests are not 16-byte aligned.
    tables = torch.zeros(len(requests), max(blocks) + 2, dtype=torch.int32)
    next_block = 1
    for i, count in enumerate(blocks):
        tables[i, :count] = torch.arange(next_block, next_block + count, dtype=torch.int32)
        next_block += count
    starts, keys, values = [0], [], []
    for i, (context, chunk) in enumerate(requests):
        starts.append(starts[-1] + chunk)
        positions = torch.arange(context - chunk, context)
        slots = tables[i, positions // block].long() * block + positions % block
        keys.append(cache[0].view(-1, kv_heads, dim)[slots])
        values.append(cache[1].view(-1, kv_heads, dim)[slots])
    query = torch.randn(starts[-1], heads, dim, generator=gen).to(device)
    cache, tables = cache.to(device), tables.to(device)
    keys, values = torch.cat(keys).to(device), torch.cat(values).to(device)
    seq_lens = [context for context, _ in requests]
    metadata = SimpleNamespace(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=(tables,),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    segments = long_prefill_segments(starts, seq_lens, max_len=300)
    assert [(s.first, s.last, s.sdpa) for s in segments] == [
        (0, 2, False),
        (2, 5, True),
        (5, 8, False),
        (8, 9, True),
        (9, 10, False),
    ]
    return query, keys, values, cache, tables, starts, seq_lens, metadata, segments


def _sdpa_from_32_tokens(monkeypatch) -> None:
    monkeypatch.setattr(sdpa_module, "SDPA_PREFILL_MIN_TOKENS", 32)
    monkeypatch.setattr(
        "ferrum.model_executor.layers.attention.sdpa_prefill",
        lambda *a, **kw: sdpa_prefill(*a, backends=[SDPBackend.MATH], **kw),
    )


@pytest.mark.parametrize("paged", ["reference", "triton"])
def test_a_mixed_step_equals_the_paged_reference(monkeypatch, device, paged) -> None:
    """The layer sends the long chunks of a mixed step (`_mixed_step`) through SDPA and the
    runs between them through the paged kernel, each onto its own rows. "triton": the real
    kernels (interpreted on the CPU) on slices of the metadata, the decode-only runs (at
    requests 0 and 9) through the split-KV path; on a GPU the chunk after a cached prefix is
    packed by the Triton gather."""
    from types import SimpleNamespace

    from ferrum.kernels.paged_attention import allocate_split_kv_workspace, paged_attention
    from ferrum.model_executor.layers.attention import Attention

    _sdpa_from_32_tokens(monkeypatch)
    heads, kv_heads, dim = 4, 2, 16
    step = _mixed_step(device, heads, kv_heads, dim)
    query, keys, values, cache, tables, starts, seq_lens, metadata, segments = step
    kernel = _paged_reference_kernel if paged == "reference" else paged_attention
    layer = Attention(heads, dim, kv_heads, 0.25, replace(triton_kernels(), paged_attention=kernel))
    workspace = allocate_split_kv_workspace(8, heads, dim, device) if paged == "triton" else None
    # The layer's cache is group 1's: group 0's tables point at the wrong blocks.
    layer.bind_kv_cache(cache, workspace, kv_cache_group=1)
    metadata.block_tables = (torch.flip(tables, (0,)), tables)
    out = layer._attend_by_segments(query, keys, values, metadata, segments)
    expected = paged_attention_ref(query, cache, tables, starts, seq_lens, 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # A step of one long chunk, fresh or after a cached prefix: SDPA's output is the layer's.
    for i in (2, 4):
        rows = slice(starts[i], starts[i + 1])
        chunk = starts[i + 1] - starts[i]
        alone = SimpleNamespace(
            query_start_loc=None,
            seq_lens=None,
            block_tables=(tables[:1], tables[i : i + 1]),
            query_start_loc_cpu=[0, chunk],
            seq_lens_cpu=[seq_lens[i]],
        )
        segments = long_prefill_segments([0, chunk], [seq_lens[i]], max_len=300)
        out = layer._attend_by_segments(query[rows], keys[rows], values[rows], alone, segments)
        torch.testing.assert_close(out, expected[rows], atol=1e-5, rtol=1e-5)


def test_a_mixed_step_writes_fp8_rows_of_its_whole_output(monkeypatch, device) -> None:
    """With heads of 128, a mixed step fills o_proj's FP8 rows: the paged kernel's runs write
    theirs, SDPA's prompts are quantized after it; every row equals the per-group pass over the
    layer's output, as on a step without SDPA."""
    from ferrum.kernels.fp8_quant import empty_group_rows, per_token_group_quant_fp8
    from ferrum.kernels.paged_attention import allocate_split_kv_workspace
    from ferrum.model_executor.layers.attention import Attention

    _sdpa_from_32_tokens(monkeypatch)
    heads, kv_heads, dim = 2, 1, 128
    query, keys, values, cache, _, starts, _, metadata, segments = _mixed_step(
        device, heads, kv_heads, dim
    )
    layer = Attention(heads, dim, kv_heads, 0.1, triton_kernels())
    layer.bind_kv_cache(cache, allocate_split_kv_workspace(8, heads, dim, device))
    assert layer.writes_fp8_rows()
    rows = empty_group_rows(query.shape[0], heads * dim, query.device)
    out = layer._attend_by_segments(query, keys, values, metadata, segments, rows)
    q, scales = per_token_group_quant_fp8(out.reshape(out.shape[0], -1))
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rows.scales, scales)
    assert starts[-1] == out.shape[0]
