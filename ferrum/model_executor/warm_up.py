"""Start-up runs every Triton kernel variant serving would otherwise compile inside a request.
A variant is picked by tile configs chosen by token count (attention up to 128 query rows, the
fused MoE's buckets 16..4096) and by Triton's specialisation of integers (1, multiples of 16,
other), so each power-of-two batch runs at an even and an odd token count, split over several
requests from 256 tokens up. The one-token logits (the LM head's GEMV) run too, and SDPA's prefill
at each padded length (cuDNN plans a shape once) with the cached-prefix gather and its cuDNN
probe, and FlashAttention-4's JIT compile where layers take it; CUDA graph capture compiles
decode and small prefill shapes after this."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from ferrum.kernels.sdpa_prefill import (
    cudnn_takes,
    padded_lengths,
    warm_up_cached_pack,
    warm_up_sdpa_prefill,
)
from ferrum.logger import init_logger
from ferrum.model_executor.compile_watch import start_up_compiles
from ferrum.model_executor.layers.attention import Attention
from ferrum.model_executor.token_bitmask import apply_token_bitmask_
from ferrum.structured_output import bitmask_width

if TYPE_CHECKING:
    from ferrum.model_executor.runner_interface import StartUpRunner

logger = init_logger(__name__)

# Single-request prefills up to this many tokens; above it, batches of up to 4 requests.
_SINGLE_REQUEST_MAX = 128
# A chunk long enough for FlashAttention-4's larger variant (see `_warm_up_flash_attention`).
_FLASH_WARM_UP_TOKENS = 1024
MULTI_REQUESTS = 4


def warm_up_batches(
    max_tokens: int, block_size: int, num_blocks: int, max_requests: int = MULTI_REQUESTS
) -> list[list[int]]:
    """Query lengths of the requests of each warm-up forward: for every power of two up to
    `max_tokens` (the most tokens one step schedules), a batch of that many tokens and one of
    a token less, split over min(MULTI_REQUESTS, max_requests) requests above 128 tokens.
    Batches whose prompts need more than `num_blocks` KV blocks are left out."""
    num_requests = max(1, min(MULTI_REQUESTS, max_requests))
    batches: list[list[int]] = []
    seen: set[int] = set()
    size = 1
    while size <= max_tokens:
        for total in (size, size - 1):
            if total < 1 or total in seen:
                continue
            seen.add(total)
            batch = _split(total, num_requests)
            if sum(-(-n // block_size) for n in batch) <= num_blocks:
                batches.append(batch)
        size *= 2
    return batches


def _split(total: int, num_requests: int) -> list[int]:
    """One request up to _SINGLE_REQUEST_MAX tokens, else `num_requests` nearly equal ones."""
    if total <= _SINGLE_REQUEST_MAX:
        return [total]
    base, extra = divmod(total, num_requests)
    return [base + (i < extra) for i in range(num_requests)]


def warm_up_runner(runner: StartUpRunner, num_blocks: int | list[int]) -> None:
    """Runs `warm_up_batches` through the runner, SDPA's prefill at each padded length (cuDNN's
    plans) with the cache gather and cuDNN probe, and, on the last pipeline stage, xgrammar's
    bitmask kernel; its compiles count as start-up's."""
    start_up_compiles()
    start = time.perf_counter()
    num_forwards, max_tokens = run_warm_up_batches(runner, num_blocks)
    sdpa_plans = _warm_up_sdpa_prefill(runner, runner.inputs.sdpa_max_len)
    flash_shapes = _warm_up_flash_attention(runner)
    _warm_up_sdpa_fp8_rows(runner)
    if runner.stage.is_last:
        _warm_up_grammar_bitmask(runner)
    torch.cuda.synchronize(runner.device)
    logger.info(
        "kernel warm-up: %d forwards of 1 to %d tokens, %d SDPA prefill lengths, %d "
        "FlashAttention-4 shapes in %.2f s",
        num_forwards,
        max_tokens,
        sdpa_plans,
        flash_shapes,
        time.perf_counter() - start,
    )


@torch.inference_mode()
def run_warm_up_batches(runner: StartUpRunner, num_blocks: int | list[int]) -> tuple[int, int]:
    """One forward per batch of `warm_up_batches`; returns (forwards, most tokens)."""
    sched = runner.config.scheduler_config
    if not isinstance(num_blocks, int):  # the smallest attention pool
        num_blocks = min(n for n, g in zip(num_blocks, runner.kv_cache_groups) if not g.recurrent)
    max_tokens = min(sched.max_num_batched_tokens, sched.max_model_len)
    # Block 0 stays free: the prompts take blocks from 1 on.
    batches = warm_up_batches(
        max_tokens, runner.block_size, num_blocks - 1, max_requests=sched.max_num_seqs
    )
    for query_lens in batches:
        hidden_states = runner.forward_prompts(query_lens)
        # Logits run outside the CUDA graphs; one row takes the LM head's own GEMV variant.
        if hidden_states is not None and len(hidden_states) == 1:
            runner.model.compute_logits(hidden_states)
    return len(batches), max_tokens


@torch.inference_mode()
def _warm_up_flash_attention(runner: StartUpRunner) -> int:
    """FlashAttention-4 compiles one kernel per layer shape on first use (on sm90 whatever the
    lengths; Blackwell has a second variant for chunks of at most 128 / group queries): calls per
    shape on a fresh chunk of 1,024 tokens and of one over the layer's bound cache, which it only
    reads. Returns the shapes warmed."""
    shapes = {}
    for module in runner.model.modules():
        if isinstance(module, Attention) and module.flash_attention is not None:
            assert module.kv_cache is not None
            key = (module.num_heads, module.num_kv_heads, module.head_dim, module.sliding_window)
            shapes.setdefault(key, module)
    for layer in shapes.values():
        cache = layer.kv_cache
        assert cache is not None and layer.flash_attention is not None
        longest = min(_FLASH_WARM_UP_TOKENS, (cache.shape[1] - 1) * cache.shape[2])
        for length in (longest, 1):  # Blackwell's two variants (sm90: the second is cached)
            on = {"device": cache.device}
            blocks = torch.arange(1, 1 + -(-length // cache.shape[2]), **on).int()[None]
            query = torch.zeros(length, layer.num_heads, layer.head_dim, dtype=cache.dtype, **on)
            bounds = torch.tensor([0, length], dtype=torch.int32, **on)
            layer.flash_attention(
                query, cache, blocks, bounds, bounds[1:], length, layer.scale, layer.sliding_window
            )
    return len(shapes)


@torch.inference_mode()
def _warm_up_sdpa_prefill(runner: StartUpRunner, max_len: int) -> int:
    """cuDNN plans per shape on first use: runs SDPA at each padded prefill length up to `max_len`
    (the longest context the step inputs send through SDPA) for each distinct attention shape
    that takes it, and the gather of a chunk after a cached prefix over the first such layer's
    cache. Where cuDNN does not take a shape (SDPA would run FlashAttention-2, no faster than the
    paged kernel after a prefix), chunks after a cached prefix keep the paged kernel."""
    layers = {}
    for module in runner.model.modules():
        if isinstance(module, Attention) and (shape := module.sdpa_prefill_shape()) is not None:
            layers.setdefault(shape, module)
    if not padded_lengths(max_len):  # no chunk reaches SDPA
        return 0
    for (heads, kv_heads, head_dim, _, dtype, device), layer in layers.items():
        assert layer.kv_cache is not None
        warm_up_cached_pack(layer.num_heads, layer.kv_cache)
        if not cudnn_takes(heads, kv_heads, head_dim, dtype, device):
            logger.info(
                "cuDNN attention does not take %d/%d heads of %d: chunks after a cached prefix "
                "attend through the paged kernel",
                heads,
                kv_heads,
                head_dim,
            )
            runner.disable_sdpa_after_prefixes()
    return sum(warm_up_sdpa_prefill(*shape, max_tokens=max_len) for shape in layers)


@torch.inference_mode()
def _warm_up_sdpa_fp8_rows(runner: StartUpRunner) -> None:
    """A step with SDPA's prompts quantizes their attention output for an FP8 o_proj by the
    per-group pass (`Attention._attend_by_segments`); no warm-up forward runs it (warm-up's
    prompts are too short for SDPA, and every other W8A8 input arrives quantized), so it runs
    once here for each row width and dtype of a layer that takes SDPA and writes FP8 rows, in a
    model with block-scaled FP8 weights."""
    quant_config = runner.config.model_config.quant_config
    if quant_config is None or quant_config.weight_scales != "block":
        return
    from ferrum.kernels.fp8_quant import per_token_group_quant_fp8

    widths = set()
    for module in runner.model.modules():
        if isinstance(module, Attention) and module.writes_fp8_rows():
            shape = module.sdpa_prefill_shape()
            if shape is not None:
                heads, _, head_dim, _, dtype, device = shape
                widths.add((heads * head_dim, dtype, device))
    for width, dtype, device in widths:
        per_token_group_quant_fp8(torch.zeros(2, width, dtype=dtype, device=device))


def _warm_up_grammar_bitmask(runner: StartUpRunner) -> None:
    """xgrammar's Triton kernel masks the sampled rows of constrained steps; Triton compiles it
    per row-count class (1, a multiple of 16, other), so one batch of each runs here."""
    width = bitmask_width(runner.vocab_size)
    for rows in (1, 2, 16):
        logits = torch.zeros(rows, runner.vocab_size, dtype=torch.float32, device=runner.device)
        allow_all = torch.full((rows, width), -1, dtype=torch.int32, device=runner.device)
        apply_token_bitmask_(logits, allow_all)
