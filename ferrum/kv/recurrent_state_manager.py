"""State slots of recurrent (linear-attention) layers: one fixed-size slot per request.

A request's table in this group is `[slot] + [NULL_BLOCK_ID] * (n - 1)`, as long as the other
groups' tables (n blocks for its computed and scheduled tokens), so the runner addresses every
group alike; the slot holds the conv and recurrent state of every layer of the group after the
request's computed tokens. The slot is taken when the request is first scheduled (its state
starts from zeros) and released when it finishes or is preempted (a preempted request
recomputes its state from its tokens).

The state after a prefix is not kept once its request ends, so this group serves no prefix
hits: a hybrid model's prefix cache never hits (see `KVCacheManager`).
"""

from __future__ import annotations

from ferrum.kv.block_pool import NULL_BLOCK_ID, BlockPool
from ferrum.kv.sliding_window_manager import UNBOUNDED_TOKENS
from ferrum.request import Request


class RecurrentStateManager:
    def __init__(self, num_slots: int, block_size: int) -> None:
        """`num_slots` includes the null slot 0, which is never handed out (padding rows)."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.block_pool = BlockPool(num_slots)
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def begin_step(self) -> None:
        pass

    def end_step(self) -> None:
        pass

    def discard_step_cache(self) -> None:
        pass

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable slots held by a request."""
        return 1.0 - self.block_pool.num_free_blocks / self.block_pool.num_usable_blocks

    def max_tokens_in_pool(self) -> int:
        """A slot holds a state of any length."""
        return UNBOUNDED_TOKENS

    def get_block_ids(self, req_id: str) -> list[int]:
        return list(self._tables.get(req_id, []))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """No prefix hits: the state of a prefix is not kept."""
        return [], 0

    def find_cached_prefix(self, request: Request, max_blocks: int) -> list[int]:
        return []

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int]
    ) -> bool:
        if computed_blocks:
            raise ValueError(
                "new_computed_blocks: a recurrent state group serves no prefix hits, got "
                f"{len(computed_blocks)} blocks for {request.req_id!r}"
            )
        return request.req_id in self._tables or self.block_pool.num_free_blocks > 0

    def covers(self, request: Request, num_new_tokens: int) -> bool:
        table = self._tables.get(request.req_id)
        return table is not None and len(table) >= self._num_entries(request, num_new_tokens)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Takes the request's slot on its first call and grows its table with null entries to
        the other groups' length. Returns the entries appended, or None when no slot is free."""
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0, got {num_new_tokens!r}")
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks or []):
            return None
        table = self._tables.get(request.req_id)
        new_entries = []
        if table is None:
            table = self._tables[request.req_id] = []
            new_entries = self.block_pool.allocate(1)
        num_entries = self._num_entries(request, num_new_tokens)
        new_entries += [NULL_BLOCK_ID] * max(num_entries - len(table) - len(new_entries), 0)
        table.extend(new_entries)
        return new_entries

    def _num_entries(self, request: Request, num_new_tokens: int) -> int:
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(-(-num_tokens // self.block_size), 1)

    def cache_computed_blocks(self, request: Request) -> None:
        pass

    def free(self, request: Request) -> None:
        """Releases the request's slot and forgets it; a no-op for unknown ids."""
        table = self._tables.pop(request.req_id, None)
        if table is not None:
            self.block_pool.free(table[:1])

    def reset_prefix_cache(self) -> bool:
        return True
