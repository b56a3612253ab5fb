"""The batches the model runner runs once at start-up so that serving compiles no Triton kernel.

A kernel variant is compiled the first time a launch needs it, inside a user's request unless the
warm-up ran it first. What picks a variant, and so what the batches below cover:
- tile configs chosen by token count: attention tiles grow with the query length up to 128 rows,
  and the fused MoE takes a config per token bucket (16 ... 4096 tokens, the largest beyond);
- Triton's specialisation of integer arguments: a count that is 1, or a multiple of 16, gets its
  own compiled kernel, so every size is run at an even and at an odd token count;
- several requests in one batch (variable-length prefill attention), from 256 tokens up.
Integers that follow a step's shape in other ways (the MoE align's spans and blocks, the block
table's width, the split-KV count) are left unspecialised in their kernels, so no batch here
needs to match them. The runner also computes the logits of the one-token batch: logits run
outside the CUDA graphs, and one row takes the LM head's GEMV. Decode batch sizes and
single-request prefill chunks up to 512 tokens are also compiled by CUDA graph capture, which
runs after this; `compile_watch.py` logs any variant compiled later.
"""

from __future__ import annotations

# Single-request prefills up to this many tokens; above it, batches of up to 4 requests.
_SINGLE_REQUEST_MAX = 128
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
