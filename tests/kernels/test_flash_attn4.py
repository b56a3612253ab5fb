"""FlashAttention-4's adapter (kernels/flash_attn4.py) on the CPU: the arguments it hands
`flash_attn_varlen_func`, checked by a torch stand-in with FlashAttention's documented semantics
(paged K/V through page_table, seqused_k, causal aligned bottom-right, window (left, right))
against ferrum's reference; the shape rules; and which steps take it."""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.attention_ref import paged_attention_ref
from ferrum.kernels.flash_attn4 import (
    FlashAttention4,
    flash_attention_step,
    flash_attn4_rejects,
)


def flash_attn_varlen_stand_in(
    q, k, v, *, cu_seqlens_q, seqused_k, max_seqlen_q, page_table, softmax_scale, causal,
    window_size,
):  # fmt: skip
    """FlashAttention's varlen forward as documented, one request at a time in fp32."""
    assert causal and k.shape == v.shape and page_table.dtype == torch.int32
    assert max_seqlen_q >= int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    page = k.shape[1]
    group = q.shape[1] // k.shape[2]
    left, right = window_size
    out = torch.zeros_like(q)
    for b in range(len(seqused_k)):
        start, end, keys = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        positions = torch.arange(keys)
        slots = page_table[b].long()[positions // page] * page + positions % page
        kb = k.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        vb = v.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        qb = q[start:end].float()
        # Query i of the chunk is aligned with key i + keys - (end - start) (bottom-right).
        diagonal = torch.arange(end - start)[:, None] + keys - (end - start)
        visible = positions[None, :] <= diagonal
        if left is not None:
            visible &= positions[None, :] >= diagonal - left
        assert right in (None, 0)
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * softmax_scale
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vb).to(q.dtype)
    return out, None


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_adapter_matches_ferrum_reference(sliding_window: int | None) -> None:
    """A decode, a chunk after a cached prefix and a fresh prompt in one step, GQA 4:2."""
    torch.manual_seed(0)
    block, heads, kv_heads, dim = 4, 4, 2, 16
    chunks, contexts = [1, 6, 9], [13, 17, 9]
    num_blocks = 1 + sum(-(-n // block) for n in contexts)
    kv_cache = torch.randn(2, num_blocks, block, kv_heads, dim)
    pool = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables, width = [], max(-(-n // block) for n in contexts)
    for n in contexts:
        blocks, pool = pool[: -(-n // block)], pool[-(-n // block) :]
        tables.append(blocks + [0] * (width - len(blocks)))
    block_tables = torch.tensor(tables, dtype=torch.int32)
    starts = [0, 1, 7, 16]
    query = torch.randn(starts[-1], heads, dim)
    fa4 = FlashAttention4(flash_attn_varlen_stand_in)
    out = fa4(
        query, kv_cache, block_tables, torch.tensor(starts, dtype=torch.int32),
        torch.tensor(contexts, dtype=torch.int32), max(chunks), 0.25, sliding_window,
    )  # fmt: skip
    expected = paged_attention_ref(
        query, kv_cache, block_tables, starts, contexts, 0.25, sliding_window
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_shape_rules() -> None:
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert flash_attn4_rejects((9, 0), bf16, bf16, 128) is None
    assert flash_attn4_rejects((10, 0), torch.float16, torch.float16, 256) is None
    assert flash_attn4_rejects((9, 0), bf16, bf16, 192) is None
    assert "Blackwell" not in (flash_attn4_rejects((10, 0), bf16, bf16, 192) or "")
    assert "heads of 192" in flash_attn4_rejects((10, 0), bf16, bf16, 192)
    assert "Hopper" in flash_attn4_rejects((8, 0), bf16, bf16, 128)
    assert "Hopper" in flash_attn4_rejects((12, 0), bf16, bf16, 128)
    assert "float32" in flash_attn4_rejects((9, 0), torch.float32, torch.float32, 128)
    assert "KV cache" in flash_attn4_rejects((9, 0), bf16, fp8, 128)
    assert "heads of 100" in flash_attn4_rejects((9, 0), bf16, bf16, 100)


def step(conversations: int, prefix: int, chunk: int, decodes: int = 0) -> tuple[list, list]:
    """(query_start_loc, seq_lens) of `conversations` chunks after `prefix` cached tokens and
    `decodes` decodes at a 8k context."""
    lens = [chunk] * conversations + [1] * decodes
    return [sum(lens[:i]) for i in range(len(lens) + 1)], [prefix + chunk] * conversations + [
        8192
    ] * decodes


@pytest.mark.parametrize(
    ("shape", "takes"),
    [
        # The bench_chunk_attention shapes (H200, Qwen3-8B heads) it won and lost.
        ((1, 3072, 512), False),
        ((8, 0, 512), False),
        ((8, 3072, 512), True),
        ((8, 0, 1024), True),
        ((1, 0, 8192), True),
        ((1, 2048, 2048), True),
        ((1, 16384, 4096), True),
        # Decodes add nothing, however long their context.
        ((1, 3072, 512, 255), False),
        ((0, 0, 0, 256), False),
    ],
)
def test_which_steps_take_it(shape: tuple[int, ...], takes: bool) -> None:
    assert flash_attention_step(*step(*shape)) is takes
