"""Per-request block tables of one layer group over its own pool, with prefix caching: block i of a
table holds tokens [i * block_size, (i + 1) * block_size) in every layer of the group. Blocks are
taken as tokens are scheduled and released, tail first, on finish or preemption; the sliding-window
manager also releases blocks that slid out of the window (null block 0 in their place).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.kv import block_hash
from ferrum.kv.block_pool import NULL_BLOCK_ID, root_entry_id
from ferrum.kv.layer_group_manager import LayerGroupManager
from ferrum.request import Request

# The entry id recorded for a released (or never held) leading block of a sliding-window table.
_NO_ENTRY = -1


@dataclass(slots=True)
class RequestBlocks:
    block_ids: list[int] = field(default_factory=list)
    # Cache entry id of the content of each leading full block handled by the prefix cache so far;
    # `len(entry_ids) <= len(block_ids)`.
    entry_ids: list[int] = field(default_factory=list)
    # Leading table entries released to the pool (sliding window): block_ids[:num_released] are 0.
    num_released: int = 0


class FullAttentionManager(LayerGroupManager):
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        self._requests: dict[str, RequestBlocks] = {}

    def max_tokens_in_pool(self) -> int:
        return self.num_usable_blocks * self.block_size

    def get_block_ids(self, req_id: str) -> list[int]:
        state = self._requests.get(req_id)
        return [] if state is None else list(state.block_ids)

    def find_cached_prefix(self, request: Request, max_blocks: int) -> list[int]:
        """The cached blocks verified, each after its parent, against the request's first full
        blocks, up to `max_blocks` (block hashes must cover them)."""
        size = self.block_size
        parent_entry_id = root_entry_id(request)
        block_ids: list[int] = []
        for i in range(max_blocks):
            block_id = self.block_pool.lookup(
                request.block_hashes[i],
                parent_entry_id,
                request.all_token_ids[i * size : (i + 1) * size],
            )
            if block_id is None:
                break
            entry = self.block_pool.entry(block_id)
            assert entry is not None
            parent_entry_id = entry.entry_id
            block_ids.append(block_id)
        return block_ids

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Grows the request's block table to cover `num_computed_tokens +
        len(new_computed_blocks) * block_size + num_new_tokens` tokens. `new_computed_blocks` (from
        `get_computed_blocks`, at admission only) gain a reference and come first. Returns the block
        ids appended, or None, changing nothing, when the pool is short. Every block full once these
        tokens are computed is then cached."""
        self.check_num_new_tokens(num_new_tokens)
        computed_blocks = new_computed_blocks or []
        state = self._requests.get(request.req_id)
        if (
            state is not None
            and not computed_blocks
            and self._nothing_to_do(request, state, num_new_tokens)
        ):
            return []
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            return None
        return self._allocate(request, num_new_tokens, computed_blocks)

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int]
    ) -> bool:
        """Whether `allocate_slots` with these arguments would find enough free blocks."""
        state = self._requests.get(request.req_id)
        num_held_blocks = 0 if state is None else len(state.block_ids)
        if computed_blocks:
            self._check_computed_blocks(request, num_held_blocks, computed_blocks)
        num_tokens = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_needed = -(-num_tokens // self.block_size) - num_held_blocks - len(computed_blocks)
        # Touching a free cached block takes it out of the free queue, so it cannot be evicted.
        pool = self.block_pool
        num_free_touched = sum(
            1 for b in computed_blocks if b != NULL_BLOCK_ID and pool.ref_count(b) == 0
        )
        return max(num_needed, 0) <= pool.num_free_blocks - num_free_touched

    def covers(self, request: Request, num_new_tokens: int) -> bool:
        """True when the request's held blocks already cover its next `num_new_tokens` tokens and
        nothing is to be cached or released: `allocate_slots` would return [] at once."""
        state = self._requests.get(request.req_id)
        return state is not None and self._nothing_to_do(request, state, num_new_tokens)

    def _nothing_to_do(self, request: Request, state: RequestBlocks, num_new_tokens: int) -> bool:
        """The decode fast path: the held blocks already cover the new tokens and no block
        becomes full, so there is nothing to allocate or cache."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return num_tokens <= len(state.block_ids) * self.block_size and (
            not self.enable_prefix_caching
            or min(num_tokens, request.num_tokens) // self.block_size <= len(state.entry_ids)
        )

    def _allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int]
    ) -> list[int]:
        state = self._requests.get(request.req_id)
        if state is None:
            state = self._requests[request.req_id] = RequestBlocks()
        size = self.block_size
        num_tokens = request.num_computed_tokens + len(computed_blocks) * size + num_new_tokens
        num_fresh = max(-(-num_tokens // size) - len(state.block_ids) - len(computed_blocks), 0)
        held = [b for b in computed_blocks if b != NULL_BLOCK_ID]
        self.block_pool.touch(held)
        for block_id in computed_blocks:
            if block_id == NULL_BLOCK_ID:
                state.entry_ids.append(_NO_ENTRY)
                state.num_released += 1
                continue
            entry = self.block_pool.entry(block_id)
            assert entry is not None
            state.entry_ids.append(entry.entry_id)
        new_block_ids = computed_blocks + self.block_pool.allocate(num_fresh)
        state.block_ids.extend(new_block_ids)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, state, min(num_tokens, request.num_tokens))
        return new_block_ids

    def cache_computed_blocks(self, request: Request) -> None:
        """Caches the full blocks whose tokens are all known and computed (or being computed by
        a launched step). For a request that ends: with async scheduling, a block whose last
        token was still being sampled when it was scheduled is cached only now."""
        state = self._requests.get(request.req_id)
        if self.enable_prefix_caching and state is not None:
            num_tokens = min(request.num_computed_tokens, request.num_tokens)
            self._cache_full_blocks(request, state, num_tokens)

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first, and forgets it. A no-op for unknown ids."""
        state = self._requests.pop(request.req_id, None)
        if state is not None:
            self.block_pool.free(reversed(state.block_ids[state.num_released :]))

    def _check_computed_blocks(
        self, request: Request, num_held_blocks: int, computed_blocks: list[int]
    ) -> None:
        if num_held_blocks or request.num_computed_tokens:
            raise ValueError(
                f"new_computed_blocks are only for a request being admitted; {request.req_id!r} "
                f"holds {num_held_blocks} blocks and {request.num_computed_tokens} computed tokens"
            )
        if len(computed_blocks) > len(request.block_hashes):
            raise ValueError(
                f"new_computed_blocks has {len(computed_blocks)} blocks but request "
                f"{request.req_id!r} has only {len(request.block_hashes)} full blocks"
            )
        found = self.find_cached_prefix(request, len(computed_blocks))
        for i, block_id in enumerate(computed_blocks):
            if i == len(found) or found[i] != block_id:
                raise ValueError(
                    f"new_computed_blocks[{i}]={block_id} does not cache block {i} of "
                    f"{request.req_id!r}; pass the result of get_computed_blocks unchanged"
                )

    def _cache_full_blocks(self, request: Request, state: RequestBlocks, num_tokens: int) -> None:
        """Caches the blocks of the first `num_tokens` tokens that are full and not yet handled."""
        num_full_blocks = num_tokens // self.block_size
        start = len(state.entry_ids)
        if num_full_blocks <= start:
            return
        block_hash.extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            request.block_hash_extra_keys,
        )
        token_ids = request.all_token_ids
        size = self.block_size
        parent_entry_id = state.entry_ids[-1] if state.entry_ids else root_entry_id(request)
        for i in range(start, num_full_blocks):
            block_id = state.block_ids[i]
            parent_entry_id = self.block_pool.cache_block(
                block_id,
                request.block_hashes[i],
                parent_entry_id,
                token_ids[i * size : (i + 1) * size],
            )
            state.entry_ids.append(parent_entry_id)
            if self._unfinished_steps and self.block_pool.entry(block_id) is not None:
                self._unfinished_steps[-1].append(block_id)
