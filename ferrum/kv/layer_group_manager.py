"""The interface `KVCacheManager` drives for each layer group of the KV cache (full attention,
sliding window, recurrent state), and what every group shares: its own pool of blocks (or state
slots), the prefix-cache lookup, and the cache entries of steps still running."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

from ferrum.kv import block_hash
from ferrum.kv.block_pool import BlockPool
from ferrum.request import Request


class LayerGroupManager(ABC):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Cache entries registered by each step begun and not yet ended, oldest first: their
        # content is only written by that step's forward, so a failed step takes them back out.
        # With async scheduling two steps can be unfinished at once.
        self._unfinished_steps: deque[list[int]] = deque()

    def begin_step(self) -> None:
        self._unfinished_steps.append([])

    def end_step(self) -> None:
        """The oldest unfinished step's forward completed: its cache entries hold real data."""
        if self._unfinished_steps:
            self._unfinished_steps.popleft()

    def discard_step_cache(self) -> None:
        """Uncaches the entries registered by every unfinished step (their forward failed)."""
        for block_ids in self._unfinished_steps:
            for block_id in block_ids:
                self.block_pool.uncache(block_id)
        self._unfinished_steps.clear()

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (or slots) held by at least one request."""
        return 1.0 - self.block_pool.num_free_blocks / self.block_pool.num_usable_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest verified cached prefix, short of the last token (which always computes:
        it yields the next token's logits): `(block_ids, num_computed_tokens)`, no references
        taken, so pass them to `allocate_slots` before any other allocation. `([], 0)` with
        caching off."""
        if not self.enable_prefix_caching:
            return [], 0
        block_hash.extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            request.block_hash_extra_keys,
        )
        block_ids = self.find_cached_prefix(request, (request.num_tokens - 1) // self.block_size)
        return block_ids, len(block_ids) * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached entry; False (and no change) while any block is in use."""
        return self.block_pool.reset_prefix_cache()

    def chunk_end(self, request: Request, start: int, end: int) -> int:
        """Where a chunk computing tokens [start, end) should end for this group."""
        return end

    @staticmethod
    def check_num_new_tokens(num_new_tokens: int) -> None:
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0, got {num_new_tokens!r}")

    @abstractmethod
    def max_tokens_in_pool(self) -> int:
        """The most tokens one request can ever hold; a longer one can never be scheduled."""

    @abstractmethod
    def get_block_ids(self, req_id: str) -> list[int]: ...

    @abstractmethod
    def find_cached_prefix(self, request: Request, max_blocks: int) -> list[int]:
        """The request's cached prefix of at most `max_blocks` blocks, verified."""

    @abstractmethod
    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int]
    ) -> bool:
        """Whether `allocate_slots` with these arguments would find enough free blocks."""

    @abstractmethod
    def covers(self, request: Request, num_new_tokens: int) -> bool:
        """True when `allocate_slots` would return [] at once (nothing to take or cache)."""

    @abstractmethod
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Grows the request's table for `num_new_tokens` more tokens (after the cached
        `new_computed_blocks`, at admission only); the entries appended, or None, changing
        nothing, when the pool is short."""

    @abstractmethod
    def cache_computed_blocks(self, request: Request) -> None:
        """Caches what the request's computed tokens complete (a request that ends)."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, and forgets it; unknown ids: a no-op."""
