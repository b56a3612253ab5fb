"""The last-arrival sum of a split-K tile (Triton): each of a tile's SPLIT_K programs stores its
fp32 partial and counts its arrival on the tile's counter (`arrival_counters.py`); the last to
arrive sums the partials in order s = 0..SPLIT_K-1 (deterministic) and resets the counter to
zero. Used by the split-K FP8 GEMM and the few-row linear (`last_to_arrive`, the count alone, by
every kernel whose programs share an output tile):

    if not arrive(acc, partials, counter, split, SPLIT_K):
        return
    acc = sum_partials(partials, counter, SPLIT_K, A, B)
"""

import triton
import triton.language as tl


@triton.jit
def _tile(A: tl.constexpr, B: tl.constexpr):
    return tl.arange(0, A)[:, None] * B + tl.arange(0, B)[None, :]


@triton.jit
def arrive(acc, partials, counter, split, SPLIT_K: tl.constexpr):
    """Stores split `split`'s partial `acc` [A, B] fp32 into the tile's [SPLIT_K, A, B] fp32
    block `partials` and counts it on the tile's int32 `counter`; whether it arrived last."""
    A: tl.constexpr = acc.shape[0]
    B: tl.constexpr = acc.shape[1]
    tl.store(partials + split * (A * B) + _tile(A, B), acc)
    return last_to_arrive(counter, SPLIT_K)


@triton.jit
def last_to_arrive(counter, arrivals):
    """Counts this program's arrival on the int32 `counter` after its partials are stored;
    whether it is the last of `arrivals`. Every thread's partial is written before the count
    (one thread's release atomic after the barrier); the last arrival reads the others'
    partials through L2 (.cg loads) after its acquire, and its caller resets the counter."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1


@triton.jit
def sum_partials(partials, counter, SPLIT_K: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """The tile's [A, B] fp32 sum over splits 0..SPLIT_K-1, in that order; resets `counter`.
    Only the last arrival calls it."""
    tile = _tile(A, B)
    acc = tl.load(partials + tile, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(partials + s * (A * B) + tile, cache_modifier=".cg")
    tl.store(counter, 0)
    return acc
