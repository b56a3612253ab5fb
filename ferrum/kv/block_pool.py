"""The pool of KV blocks: ref counts, the LRU free queue and the prefix cache (hash -> block).
Block 0 is the null block (padding): never allocated, never freed. A block is free when its ref
count is 0; every free block is in `_free_queue`, whose front is evicted (re-allocated) first. A
free block may still hold a cached entry: its KV stays valid and can be hit until it is evicted."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrum.request import Request

NULL_BLOCK_ID = 0
# The parent entry id of a sequence's first block (a base-model request's: `root_entry_id`).
ROOT_ENTRY_ID = 0


def root_entry_id(request: Request) -> int:
    """The parent entry id of a request's first block: ROOT_ENTRY_ID, or minus its LoRA
    adapter's id (entry ids are positive), so that a first block computed with another adapter
    never verifies, even when its hash collides: KV is never shared across adapters."""
    return ROOT_ENTRY_ID if request.lora is None else -request.lora.lora_int_id


@dataclass(slots=True)
class CacheEntry:
    """What a cached block holds: the exact tokens it was computed from. `entry_id` is unique over
    the pool's lifetime and `parent_entry_id` names the previous block's entry, so a chain of
    verified entries pins every token of the prefix: a hit returns KV of exactly those tokens."""

    entry_id: int
    block_hash: int
    parent_entry_id: int
    token_ids: tuple[int, ...]


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an integer >= 2 (block 0 is reserved), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._entries: list[CacheEntry | None] = [None] * num_blocks
        # Free block ids in eviction order (front first); values are unused.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # At most one block per hash; a second block with the same hash stays unregistered.
        self._cached: dict[int, int] = {}
        self._next_entry_id = ROOT_ENTRY_ID + 1

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (the next one allocated first)."""
        return list(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def entry(self, block_id: int) -> CacheEntry | None:
        return self._entries[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes `num_blocks` free blocks from the front of the queue (ref count 1 each).

        An evicted block loses its cache entry. The caller checks `num_free_blocks` first.
        """
        if num_blocks > len(self._free_queue):
            raise ValueError(
                f"num_blocks={num_blocks} exceeds the {len(self._free_queue)} free blocks"
            )
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            entry = self._entries[block_id]
            if entry is not None:
                del self._cached[entry.block_hash]
                self._entries[block_id] = None
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes one more reference on each block, taking free ones out of the free queue."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:
                raise ValueError("block_ids must not contain the null block 0")
            if self._ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference per block, in the order given.

        A block whose count reaches 0 joins the free queue: at the back (evicted last) when it
        holds a cache entry, at the front (reused first) when it holds nothing worth keeping.
        """
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                raise ValueError(f"block_ids: block {block_id} is already free")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free_queue[block_id] = None
                if self._entries[block_id] is None:
                    self._free_queue.move_to_end(block_id, last=False)

    def lookup(self, block_hash: int, parent_entry_id: int, token_ids: Sequence[int]) -> int | None:
        """The cached block with exactly these tokens after exactly this parent, or None."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        entry = self._entries[block_id]
        assert entry is not None
        if entry.parent_entry_id != parent_entry_id or entry.token_ids != tuple(token_ids):
            return None
        return block_id

    def find(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        """The cached block with this hash and exactly these tokens, whatever its parent."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        entry = self._entries[block_id]
        assert entry is not None
        return block_id if entry.token_ids == tuple(token_ids) else None

    def cache_block(
        self, block_id: int, block_hash: int, parent_entry_id: int, token_ids: Sequence[int]
    ) -> int:
        """Registers a full, in-use block in the prefix cache and returns its content's entry id.
        When the hash is taken by a block with the same tokens and parent, `block_id` stays
        unregistered and that block's entry id is returned (same KV). When taken by other content (a
        collision), `block_id` stays unregistered under a fresh entry id no cached block has, so
        nothing chained after it can ever be hit."""
        if self._ref_counts[block_id] == 0 or self._entries[block_id] is not None:
            raise ValueError(f"block_id: block {block_id} must be in use and not yet cached")
        token_ids = tuple(token_ids)
        holder = self._cached.get(block_hash)
        if holder is not None:
            entry = self._entries[holder]
            assert entry is not None
            if entry.parent_entry_id == parent_entry_id and entry.token_ids == token_ids:
                return entry.entry_id
            return self._new_entry_id()
        entry = CacheEntry(self._new_entry_id(), block_hash, parent_entry_id, token_ids)
        self._entries[block_id] = entry
        self._cached[block_hash] = block_id
        return entry.entry_id

    def uncache(self, block_id: int) -> None:
        """Forgets the cached content of a block (no-op if it has none); nothing chained after it
        can be hit any more, since a hit needs its parent's entry."""
        entry = self._entries[block_id]
        if entry is None:
            return
        if self._cached.get(entry.block_hash) == block_id:
            del self._cached[entry.block_hash]
        self._entries[block_id] = None

    def reset_prefix_cache(self) -> bool:
        """Drops every cache entry when no block is in use (False and no change otherwise).

        The free queue goes back to a fresh pool's order.
        """
        if len(self._free_queue) != self.num_usable_blocks:
            return False
        self._cached.clear()
        self._entries = [None] * self.num_blocks
        self._free_queue = OrderedDict.fromkeys(range(1, self.num_blocks))
        return True

    def _new_entry_id(self) -> int:
        entry_id = self._next_entry_id
        self._next_entry_id += 1
        return entry_id
