"""Chained hashes of full KV blocks: a block's prefix-cache key depends on every token before it.
`hash_i = H(hash_{i-1}, tokens of block i, extra_keys)`, `hash_{-1} = NONE_HASH`, H Python's
builtin `hash` of a tuple of ints (deterministic for ints, in and across processes). Equal hashes
are only a hint: the block pool verifies the tokens and the parent of every hit, so a collision
costs a cache miss, never wrong KV."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

# The parent hash of a sequence's first block.
NONE_HASH = 0


def hash_block_tokens(
    parent_hash: int, token_ids: Sequence[int], extra_keys: tuple[Hashable, ...] | None = None
) -> int:
    """The hash of one full block given its parent block's hash and its token ids.

    `extra_keys` holds whatever else changes the block's KV for the same tokens (an adapter id,
    multimodal content hashes); None when nothing does.
    """
    if extra_keys is None:
        return hash((parent_hash, tuple(token_ids)))
    return hash((parent_hash, tuple(token_ids), extra_keys))


def extend_block_hashes(
    block_hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[Hashable, ...] | None = None,
) -> int:
    """Appends to `block_hashes` the hashes of the full blocks of `token_ids` it lacks; returns how
    many. Keeps `block_hashes[i]` the chained hash of `token_ids[:(i + 1) * block_size]` and
    `len(block_hashes) == len(token_ids) // block_size`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_full_blocks = len(token_ids) // block_size
    start = len(block_hashes)
    if start > num_full_blocks:
        raise ValueError(
            f"block_hashes has {start} entries but token_ids holds only {num_full_blocks} "
            f"full blocks of {block_size}"
        )
    parent_hash = block_hashes[-1] if block_hashes else NONE_HASH
    for i in range(start, num_full_blocks):
        # Looked up through the module so tests can substitute a colliding hash function.
        parent_hash = hash_block_tokens(
            parent_hash, token_ids[i * block_size : (i + 1) * block_size], extra_keys
        )
        block_hashes.append(parent_hash)
    return num_full_blocks - start
