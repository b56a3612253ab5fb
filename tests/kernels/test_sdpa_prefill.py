"""Long prompt chunks through torch's SDPA: which steps take it, and the same attention as the
paged path (the torch reference on the CPU with SDPA's math backend, the Triton kernel with
cuDNN / flash on CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

import ferrum.kernels.sdpa_prefill as sdpa_module
from ferrum.kernels.attention_ref import paged_attention_ref
from ferrum.kernels.sdpa_prefill import (
    SDPA_PREFILL_MIN_TOKENS,
    CachedContext,
    long_chunk_in_step,
    long_prefill_segments,
    padded_length,
    padded_lengths,
    sdpa_prefill,
    sdpa_takes,
)
from ferrum.model_executor.cuda_graph import PREFILL_SIZES

MIN = SDPA_PREFILL_MIN_TOKENS


def test_graph_replayed_chunks_never_take_it() -> None:
    assert max(PREFILL_SIZES) < MIN


@pytest.mark.parametrize(
    "query_start_loc, seq_lens, expected",
    [
        ([0, MIN], [MIN], [(0, 1, True)]),
        ([0, MIN, 3 * MIN], [MIN, 2 * MIN], [(0, 2, True)]),
        ([0, MIN - 1], [MIN - 1], []),  # short
        ([0, MIN], [MIN + 16], [(0, 1, True)]),  # a short cached prefix before the chunk
        ([0, MIN], [3 * MIN], [(0, 1, True)]),  # a prefix of two chunks: still SDPA's
        ([0, MIN], [3 * MIN + 1], []),  # a longer one: the paged kernel's
        ([0, 2 * MIN], [4 * MIN], [(0, 1, True)]),  # a context as long as start-up's plans
        ([0, 2 * MIN], [4 * MIN + 1], []),  # a longer one
        # Decodes, a fresh prompt, a later chunk, a fresh prompt, a short first chunk.
        (
            [0, 1, 2, 2 + MIN, 2 + MIN + 100, 2 + 3 * MIN, 2 + 3 * MIN + 7],
            [40, 90, MIN, MIN + 100, 2 * MIN - 100, 7],
            [(0, 2, False), (2, 3, True), (3, 4, False), (4, 5, True), (5, 6, False)],
        ),
        ([0], [], []),
    ],
)
def test_segments_split_the_step_at_long_chunks(query_start_loc, seq_lens, expected):
    segments = long_prefill_segments(query_start_loc, seq_lens, max_len=4 * MIN)
    assert [(s.first, s.last, s.sdpa) for s in segments] == expected
    # Where start-up turned chunks after a prefix off (no cuDNN), only fresh ones take SDPA.
    fresh_only = long_prefill_segments(query_start_loc, seq_lens, 4 * MIN, prefix_per_chunk=0)
    fresh = [
        query_start_loc[i + 1] - query_start_loc[i] == n >= MIN for i, n in enumerate(seq_lens)
    ]
    assert [i for s in fresh_only if s.sdpa for i in range(s.first, s.last)] == [
        i for i, taken in enumerate(fresh) if taken
    ]
    # Each run carries its longest chunk and context, for the paged kernel's bounds.
    for s in segments:
        chunks = [query_start_loc[i + 1] - query_start_loc[i] for i in range(s.first, s.last)]
        assert (s.max_query_len, s.max_seq_len) == (max(chunks), max(seq_lens[s.first : s.last]))


def test_only_gpus_half_precision_and_long_chunks_take_it() -> None:
    cpu, fp32, bf16 = torch.device("cpu"), torch.float32, torch.bfloat16
    assert long_chunk_in_step(MIN) and not long_chunk_in_step(MIN - 1)
    assert not sdpa_takes(cpu, bf16, 128)
    if torch.cuda.is_available():
        gpu = torch.device("cuda", torch.cuda.current_device())
        assert not sdpa_takes(gpu, fp32, 128)
        assert sdpa_takes(gpu, bf16, 128) == (torch.cuda.get_device_capability() >= (8, 0))
        assert not sdpa_takes(gpu, bf16, 264) and not sdpa_takes(gpu, bf16, 100)


def test_padded_lengths_are_few_and_close() -> None:
    assert padded_lengths(8192) == [*range(2048, 4097, 256), *range(4608, 8193, 512)]
    assert padded_lengths(8000)[-1] == 8192 and padded_lengths(MIN - 1) == []
    for length in range(MIN, 20_000):
        padded = padded_length(length)
        assert length <= padded <= 1.125 * length
        assert padded in padded_lengths(max(length, 8192))


def _problem(lengths: list[int], dtype: torch.dtype, device: str, heads=4, kv_heads=2, dim=32):
    gen = torch.Generator().manual_seed(sum(lengths))
    total = sum(lengths)
    # Views of one packed projection output, as the models hand them to the layer.
    qkv = torch.randn(total, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(total, heads, dim), k.view(total, kv_heads, dim), v.view(total, kv_heads, dim)
    # The same keys and values in a paged cache of 16-token blocks, each request on its own.
    blocks = [-(-n // 16) for n in lengths]
    cache = torch.zeros(2, sum(blocks) + 1, 16, kv_heads, dim, dtype=dtype, device=device)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32, device=device)
    next_block, start = 1, 0
    for i, n in enumerate(lengths):
        ids = torch.arange(next_block, next_block + blocks[i], device=device)
        tables[i, : blocks[i]] = ids.to(torch.int32)
        slots = ids.repeat_interleave(16)[:n] * 16 + torch.arange(n, device=device) % 16
        cache[0].view(-1, kv_heads, dim)[slots] = k[start : start + n]
        cache[1].view(-1, kv_heads, dim)[slots] = v[start : start + n]
        next_block, start = next_block + blocks[i], start + n
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return q, k, v, cache, tables, starts


def test_equals_the_paged_reference_on_the_cpu() -> None:
    lengths = [37, 70]
    q, k, v, cache, tables, starts = _problem(lengths, torch.float32, "cpu")
    out = sdpa_prefill(q, k, v, starts, 0.3, torch.empty_like(q), backends=[SDPBackend.MATH])
    expected = paged_attention_ref(q, cache, tables, starts, lengths, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # One request, no `out`: SDPA's own output, token-major and contiguous.
    alone = sdpa_prefill(q[:37], k[:37], v[:37], [0, 37], 0.3, None, backends=[SDPBackend.MATH])
    assert alone.shape == (37, 4, 32) and alone.is_contiguous()
    torch.testing.assert_close(alone, expected[:37], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="out: None takes one request, got 2"):
        sdpa_prefill(q, k, v, starts, 0.3, None, backends=[SDPBackend.MATH])


def test_chunks_after_a_cached_prefix_equal_the_paged_reference_on_the_cpu() -> None:
    """Chunks of 30 and 50 tokens after cached prefixes of 7 and 60: the queries at the end of
    a square problem over the whole context, keys and values from the cache."""
    contexts = [37, 110]
    q, _, _, cache, tables, _ = _problem(contexts, torch.float32, "cpu")
    chunks = [30, 50]
    rows = torch.cat([q[:37][7:], q[37:][60:]])
    starts = [0, 30, 80]
    context = CachedContext(cache, tables, contexts)
    out = torch.empty_like(rows)
    sdpa_prefill(rows, rows, rows, starts, 0.3, out, [SDPBackend.MATH], context)
    expected = paged_attention_ref(rows, cache, tables, starts, contexts, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    alone = sdpa_prefill(
        rows[30:], rows[30:], rows[30:], [0, 50], 0.3, None, [SDPBackend.MATH],
        CachedContext(cache, tables[1:], contexts[1:]),
    )  # fmt: skip
    assert alone.shape == (chunks[1], 4, 32) and alone.is_contiguous()
    torch.testing.assert_close(alone, expected[30:], atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cudnn_or_flash_agree_with_the_triton_kernel() -> None:
    from ferrum.kernels.paged_attention import paged_attention

    lengths = [600, 1000]
    q, k, v, cache, tables, starts = _problem(lengths, torch.bfloat16, "cuda", 8, 2, 128)
    out = sdpa_prefill(q, k, v, starts, 128**-0.5, torch.empty_like(q))
    expected = paged_attention(
        q,
        cache,
        tables,
        torch.tensor(starts, dtype=torch.int32, device="cuda"),
        torch.tensor(lengths, dtype=torch.int32, device="cuda"),
        max(lengths),
        max(lengths),
        128**-0.5,
        torch.empty_like(q),
    )
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "model, budget",
    [("qwen3", 8192), ("qwen3", 160), ("gemma3", 160), ("qwen3_5", 160)],
)
def test_an_engine_prefilling_through_sdpa_keeps_the_tokens(
    tiny_checkpoint, monkeypatch, model, budget
):
    """Long prompts (the threshold lowered to the tiny model's length, eager so no graph holds
    a prefill) through SDPA: the generated tokens are the paged-path engine's greedy choices
    after the same prefix (bf16 rounds the two paths differently, so a near-tie may flip). The
    160-token budget mixes decodes, later chunks and short first chunks into SDPA's steps, and
    the 150-token prompt's second chunk (about 110 tokens) takes SDPA over its cached first;
    a second round extends two prompts, whose prefix-cache hits precede chunks that take SDPA
    (at 8,192 tokens too); gemma3 mixes sliding-window layers (paged) with global ones (SDPA),
    qwen3_5 gated attention layers with DeltaNet ones."""
    from tests.utils.tiny_llm import cuda_llm, greedy, random_prompts, teacher_forced_agreement

    calls, prefixes = [], []
    real = sdpa_module.sdpa_prefill

    def recorded(query, key, value, starts, *args, context=None, **kwargs):
        calls.append(1)
        chunks = [b - a for a, b in zip(starts[:-1], starts[1:])]
        prefixes.extend(n - chunk for n, chunk in zip(context.seq_lens, chunks))
        return real(query, key, value, starts, *args, context=context, **kwargs)

    monkeypatch.setattr(sdpa_module, "SDPA_PREFILL_MIN_TOKENS", 64)
    monkeypatch.setattr("ferrum.model_executor.layers.attention.sdpa_prefill", recorded)
    path = tiny_checkpoint(model)
    prompts = random_prompts([70, 90, 120, 150, 30, 200], seed=4)
    engine_args = dict(
        dtype="bfloat16", num_kv_blocks=128, enforce_eager=True, max_num_batched_tokens=budget
    )
    llm = cuda_llm(path, **engine_args)
    outputs = greedy(llm, prompts)
    assert calls
    assert (max(prefixes) > 0) == (budget == 160)
    prefixes.clear()
    # 70 + 66 and 90 + 70 tokens: hits of 64 and 80 tokens (full blocks), chunks of 72 and 80.
    extended = [p + q for p, q in zip(prompts[:2], random_prompts([66, 70], seed=5))]
    extended_outputs = greedy(llm, extended)
    if model == "qwen3":  # the hybrid models hit at their own block or snapshot boundaries
        assert max(prefixes) >= 64
    monkeypatch.setattr(sdpa_module, "SDPA_PREFILL_MIN_TOKENS", 1 << 30)
    reference = cuda_llm(path, **engine_args)
    assert teacher_forced_agreement(reference, prompts, outputs) >= 0.9
    assert teacher_forced_agreement(reference, extended, extended_outputs) >= 0.9


def test_the_engine_imports_without_triton() -> None:
    """Triton is only a GPU engine's dependency: the runner (which warms SDPA up) and the
    attention layer must not import it, nor this module's pack kernel."""
    import subprocess
    import sys

    code = (
        "import sys; import ferrum.model_executor.model_runner, ferrum.entrypoints.llm; "
        "print('triton' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "False"
