"""State slots of recurrent (linear-attention) layers: one live slot per request plus snapshots at
block boundaries for the prefix cache. A request's table is as long as the other groups':
- entry 0: the live slot (every layer's conv and recurrent state after the computed tokens), taken
  at first scheduling, released on finish or preemption (the state is then recomputed).
- entry b - 1 (b >= 2 a multiple of `snapshot_interval_blocks`) may hold a snapshot of the state
  after b blocks, taken when a chunk ends exactly there and filled by the runner from the live slot
  after the forward; cached under block b - 1's chained hash at the next `begin_step` (so no
  request of its step hits it unwritten). Every other entry: the null slot 0.
A hit of b blocks is `[0] * (b - 1) + [snapshot]` with a fresh live slot, into which the runner
copies the snapshot before the forward; the request holds the snapshot until its next allocation."""

from __future__ import annotations

from ferrum.kv import block_hash
from ferrum.kv.block_pool import NULL_BLOCK_ID, root_entry_id
from ferrum.kv.layer_group_manager import LayerGroupManager
from ferrum.kv.sliding_window_manager import UNBOUNDED_TOKENS
from ferrum.request import Request


class RecurrentStateManager(LayerGroupManager):
    def __init__(
        self,
        num_slots: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        snapshot_interval_blocks: int = 2,
    ) -> None:
        """`num_slots` includes the null slot 0, which is never handed out (padding rows)."""
        super().__init__(num_slots, block_size, enable_prefix_caching)
        if not isinstance(snapshot_interval_blocks, int) or snapshot_interval_blocks < 2:
            raise ValueError(
                "snapshot_interval_blocks must be an integer >= 2, "
                f"got {snapshot_interval_blocks!r}"
            )
        self.snapshot_interval_blocks = snapshot_interval_blocks
        self._tables: dict[str, list[int]] = {}
        # Snapshot slots each request holds until its next allocation (or its end).
        self._held: dict[str, list[int]] = {}
        # Snapshots taken this scheduling pass, cached at the next begin_step: (slot, block index,
        # request) — the request's hashes and tokens cover the block.
        self._pending: list[tuple[int, int, Request]] = []

    def begin_step(self) -> None:
        registered = [self._cache_snapshot(*pending) for pending in self._pending]
        self._pending = []
        if self._unfinished_steps:  # the previous step, still running (async scheduling)
            self._unfinished_steps[-1].extend(s for s in registered if s is not None)
        super().begin_step()

    def discard_step_cache(self) -> None:
        super().discard_step_cache()
        self._pending = []

    def max_tokens_in_pool(self) -> int:
        """A slot holds a state of any length."""
        return UNBOUNDED_TOKENS

    def get_block_ids(self, req_id: str) -> list[int]:
        return list(self._tables.get(req_id, []))

    def find_cached_prefix(self, request: Request, max_blocks: int) -> list[int]:
        """The longest b <= max_blocks with a cached snapshot after b blocks:
        [0] * (b - 1) + [snapshot slot]; [] when there is none."""
        if not self.enable_prefix_caching:
            return []
        interval, size = self.snapshot_interval_blocks, self.block_size
        for b in range(max_blocks // interval * interval, 0, -interval):
            tokens = request.all_token_ids[(b - 1) * size : b * size]
            slot = self.block_pool.find(request.block_hashes[b - 1], tokens)
            if slot is not None:
                return [NULL_BLOCK_ID] * (b - 1) + [slot]
        return []

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int]
    ) -> bool:
        """Whether a live slot (and the hit's snapshot) can be held; first releases the
        snapshots the request held since its previous allocation (their step is launched)."""
        self._release_held(request.req_id)
        pool = self.block_pool
        needed = 0 if request.req_id in self._tables else 1
        if computed_blocks and pool.ref_count(computed_blocks[-1]) == 0:
            needed += 1  # touching a free snapshot takes it out of the free queue
        return needed <= pool.num_free_blocks

    def covers(self, request: Request, num_new_tokens: int) -> bool:
        table = self._tables.get(request.req_id)
        return (
            table is not None
            and not self._held.get(request.req_id)
            and len(table) >= self._num_entries(request.num_computed_tokens + num_new_tokens)
        )

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Takes the request's live slot on its first call (and the hit's snapshot), grows its
        table to the other groups' length and takes a snapshot slot when the chunk ends on a
        snapshot boundary. Returns the entries appended, or None, changing nothing but releasing
        held snapshots, when no live slot is free."""
        self.check_num_new_tokens(num_new_tokens)
        computed = new_computed_blocks or []
        self._release_held(request.req_id)
        if computed:
            self._check_computed_blocks(request, computed)
        if not self.can_allocate(request, num_new_tokens, computed):
            return None
        pool = self.block_pool
        table = self._tables.get(request.req_id)
        new_entries: list[int] = []
        if table is None:
            table = self._tables[request.req_id] = []
            new_entries = pool.allocate(1)
            if computed:
                pool.touch(computed[-1:])
                self._held.setdefault(request.req_id, []).append(computed[-1])
                new_entries += computed[1:]
        start = request.num_computed_tokens + len(computed) * self.block_size
        end = start + num_new_tokens
        num_entries = self._num_entries(end)
        new_entries += [NULL_BLOCK_ID] * max(num_entries - len(table) - len(new_entries), 0)
        snapshot_block = self._snapshot_block(request, start, end)
        if snapshot_block is not None:
            slot = pool.allocate(1)[0]
            new_entries[snapshot_block - len(table)] = slot
            self._held.setdefault(request.req_id, []).append(slot)
            self._pending.append((slot, snapshot_block, request))
        table.extend(new_entries)
        return new_entries

    def chunk_end(self, request: Request, start: int, end: int) -> int:
        """`end`, or the last snapshot boundary in (start, end) where a snapshot would be kept
        (the chunk then covers the boundary's whole block and stops there)."""
        if not self.enable_prefix_caching:
            return end
        interval = self.snapshot_interval_blocks * self.block_size
        boundary = (end - 1) // interval * interval  # the last one strictly before end
        if boundary <= start:
            return end
        return boundary if self._snapshot_block(request, start, boundary) is not None else end

    def _snapshot_block(self, request: Request, start: int, end: int) -> int | None:
        """The block whose end gets a snapshot after computing tokens [start, end), or None."""
        size = self.block_size
        if not self.enable_prefix_caching or end % (self.snapshot_interval_blocks * size):
            return None
        block = end // size - 1
        if start > end - size or end > request.num_tokens or self.block_pool.num_free_blocks < 1:
            return None
        tokens = request.all_token_ids[block * size : end]
        block_hash.extend_block_hashes(
            request.block_hashes, request.all_token_ids, size, request.block_hash_extra_keys
        )
        if self.block_pool.find(request.block_hashes[block], tokens) is not None:
            return None  # already cached
        return block

    def _cache_snapshot(self, slot: int, block: int, request: Request) -> int | None:
        size = self.block_size
        if slot not in self._held.get(request.req_id, ()):
            return None  # its request ended (or was preempted) before this pass
        tokens = request.all_token_ids[block * size : (block + 1) * size]
        self.block_pool.cache_block(
            slot, request.block_hashes[block], root_entry_id(request), tokens
        )
        return slot if self.block_pool.entry(slot) is not None else None

    def _num_entries(self, num_tokens: int) -> int:
        return max(-(-num_tokens // self.block_size), 1)

    def _release_held(self, req_id: str) -> None:
        held = self._held.pop(req_id, None)
        if held:
            self.block_pool.free(reversed(held))

    def _check_computed_blocks(self, request: Request, computed: list[int]) -> None:
        if request.req_id in self._tables or request.num_computed_tokens:
            raise ValueError(
                f"new_computed_blocks are only for a request being admitted; {request.req_id!r} "
                "holds a state slot"
            )
        if computed != self.find_cached_prefix(request, len(computed)):
            raise ValueError(
                f"new_computed_blocks {computed} are not a cached state snapshot after the first "
                f"{len(computed)} blocks of {request.req_id!r}; pass the result of "
                "get_computed_blocks unchanged"
            )

    def cache_computed_blocks(self, request: Request) -> None:
        pass

    def free(self, request: Request) -> None:
        """Releases the request's live slot and held snapshots and forgets it; a no-op for
        unknown ids."""
        self._release_held(request.req_id)
        table = self._tables.pop(request.req_id, None)
        if table is not None:
            self.block_pool.free(table[:1])
