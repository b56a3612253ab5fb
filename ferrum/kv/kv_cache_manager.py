"""The KV cache of every layer group behind one API: the scheduler sees one request. Each group
(full attention, sliding window, recurrent) has its own pool and per-request table; block ids travel
as one list per group, in group order. `allocate_slots` grows every group's table for the same
tokens or none; a prefix hit is the longest every group can serve, so its KV is exactly what a cold
run computes. A recurrent group serves only prefixes ending at a state snapshot, so a hybrid
model's prefill chunks end on a snapshot boundary when one falls inside (`chunk_end`)."""

from __future__ import annotations

from collections.abc import Sequence

from ferrum.kv import block_hash
from ferrum.kv.kv_cache_spec import KVCacheGroupSpec
from ferrum.kv.layer_group_manager import LayerGroupManager
from ferrum.kv.recurrent_state_manager import RecurrentStateManager
from ferrum.kv.single_type_manager import FullAttentionManager
from ferrum.kv.sliding_window_manager import SlidingWindowManager
from ferrum.request import Request

# Block ids per layer group.
GroupBlockIds = tuple[list[int], ...]
_FULL_ATTENTION = (KVCacheGroupSpec(()),)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int | Sequence[int],
        block_size: int,
        enable_prefix_caching: bool = True,
        groups: Sequence[KVCacheGroupSpec] = _FULL_ATTENTION,
        max_num_batched_tokens: int | None = None,
        snapshot_interval_blocks: int = 16,
    ) -> None:
        """`num_blocks`: each group's pool size (one number for all, or one per group).
        `max_num_batched_tokens` (the largest chunk a step computes) is needed with a sliding
        window: the window before a chunk and the chunk are held together."""
        if not groups:
            raise ValueError("groups: the KV cache needs at least one layer group")
        counts = [num_blocks] * len(groups) if isinstance(num_blocks, int) else list(num_blocks)
        if len(counts) != len(groups):
            raise ValueError(
                f"num_blocks: expected one pool size per layer group ({len(groups)}), "
                f"got {len(counts)}"
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.specs = tuple(groups)
        self.groups: list[LayerGroupManager] = []
        self._recurrent: list[RecurrentStateManager] = []
        for spec, count in zip(groups, counts):
            if spec.recurrent:
                group: LayerGroupManager = RecurrentStateManager(
                    count, block_size, enable_prefix_caching, snapshot_interval_blocks
                )
                self._recurrent.append(group)
            elif spec.sliding_window is None:
                group = FullAttentionManager(count, block_size, enable_prefix_caching)
            else:
                if max_num_batched_tokens is None:
                    raise ValueError("max_num_batched_tokens: needed by a sliding-window group")
                group = SlidingWindowManager(
                    count,
                    block_size,
                    spec.sliding_window,
                    max_num_batched_tokens,
                    enable_prefix_caching,
                )
            self.groups.append(group)
        self._single = self.groups[0] if len(self.groups) == 1 else None
        # Tokens looked up in / served from the prefix cache (first lookup per admission).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def begin_step(self) -> None:
        for group in self.groups:
            group.begin_step()

    def end_step(self) -> None:
        """The oldest unfinished step's forward completed: its cache entries hold real KV."""
        for group in self.groups:
            group.end_step()

    def discard_step_cache(self) -> None:
        """Uncaches the blocks registered by every unfinished step (their forward failed)."""
        for group in self.groups:
            group.discard_step_cache()

    @property
    def num_usable_blocks(self) -> int:
        return sum(group.num_usable_blocks for group in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(group.num_free_blocks for group in self.groups)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (all groups together) held by at least one request."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def max_tokens_in_pool(self) -> int:
        """The most tokens one request can ever hold; a longer one can never be scheduled."""
        return min(group.max_tokens_in_pool() for group in self.groups)

    def chunk_end(self, request: Request, start: int, end: int) -> int:
        """Where a chunk computing tokens [start, end) should end: at the last snapshot boundary
        inside it that a recurrent group would keep a new snapshot at, else at `end`."""
        for group in self._recurrent:
            end = group.chunk_end(request, start, end)
        return end

    def get_block_ids(self, req_id: str) -> GroupBlockIds:
        return tuple(group.get_block_ids(req_id) for group in self.groups)

    def get_computed_blocks(
        self, request: Request, record_stats: bool = True
    ) -> tuple[GroupBlockIds, int]:
        """The longest cached prefix of full blocks, short of the last token, that every group
        holds: `(block ids per group, num_computed_tokens)`. Takes no references, so the blocks
        must be passed to `allocate_slots` before any other allocation."""
        if self._single is not None:
            block_ids, num_computed = self._single.get_computed_blocks(request)
            hits: GroupBlockIds = (block_ids,)
        else:
            hits, num_computed = self._find_common_prefix(request)
        if record_stats and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_computed
        return hits, num_computed

    def _find_common_prefix(self, request: Request) -> tuple[GroupBlockIds, int]:
        if not self.enable_prefix_caching:
            return tuple([] for _ in self.groups), 0
        block_hash.extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            request.block_hash_extra_keys,
        )
        num_blocks = (request.num_tokens - 1) // self.block_size
        # Each group serves at most num_blocks; shrinking it may change a window group's answer,
        # so go round until every group serves the same length (it only ever shrinks).
        hits: list[list[int]] = [[] for _ in self.groups]
        settled = 0
        while settled < len(self.groups):
            settled = 0
            for g, group in enumerate(self.groups):
                hits[g] = group.find_cached_prefix(request, num_blocks)
                if len(hits[g]) == num_blocks:
                    settled += 1
                else:
                    num_blocks = len(hits[g])
        return tuple(hits), num_blocks * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlockIds | None = None,
    ) -> GroupBlockIds | None:
        """Grows every group's block table to cover the request's computed, cached and new
        tokens (see `FullAttentionManager.allocate_slots`). Returns the block ids appended per
        group, or None, allocating nothing, when any group's pool is short."""
        if self._single is not None:
            computed = new_computed_blocks[0] if new_computed_blocks else None
            new_block_ids = self._single.allocate_slots(request, num_new_tokens, computed)
            return None if new_block_ids is None else (new_block_ids,)
        if new_computed_blocks is None and all(
            group.covers(request, num_new_tokens) for group in self.groups
        ):
            return tuple([] for _ in self.groups)
        computed_per_group = new_computed_blocks or tuple([] for _ in self.groups)
        if len(computed_per_group) != len(self.groups):
            raise ValueError(
                f"new_computed_blocks: expected one list per layer group ({len(self.groups)}), "
                f"got {len(computed_per_group)}"
            )
        lengths = {len(blocks) for blocks in computed_per_group}
        if len(lengths) != 1:
            raise ValueError(
                "new_computed_blocks: every layer group must hit the same number of blocks, "
                f"got {sorted(lengths)}; pass the result of get_computed_blocks unchanged"
            )
        for group, computed in zip(self.groups, computed_per_group):
            if not group.can_allocate(request, num_new_tokens, computed):
                return None
        return tuple(
            group.allocate_slots(request, num_new_tokens, computed) or []
            for group, computed in zip(self.groups, computed_per_group)
        )

    def cache_computed_blocks(self, request: Request) -> None:
        """Caches every group's full blocks whose tokens are all known and computed."""
        for group in self.groups:
            group.cache_computed_blocks(request)

    def free(self, request: Request) -> None:
        """Releases the request's blocks in every group and forgets it; a no-op for unknown ids."""
        for group in self.groups:
            group.free(request)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; False (and no change) while any block is in use."""
        if any(group.usage > 0.0 for group in self.groups):
            return False
        return all([group.reset_prefix_cache() for group in self.groups])
