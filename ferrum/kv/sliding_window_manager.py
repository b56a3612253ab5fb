"""Block tables of sliding-window layers: blocks that left every future window are released."""

from __future__ import annotations

from ferrum.kv.block_pool import NULL_BLOCK_ID, root_entry_id
from ferrum.kv.single_type_manager import FullAttentionManager, RequestBlocks
from ferrum.request import Request

# max_tokens_in_pool of a group that releases old blocks: no request length is too long for it.
UNBOUNDED_TOKENS = 1 << 62


class SlidingWindowManager(FullAttentionManager):
    """Block tables of sliding-window layers (p reads p - W < k <= p). Before tokens from position c
    are allocated, blocks wholly below c - W + 1 are released (cached ones stay hittable), so a
    decode holds at most ceil((W - 1) / block_size) + 2 blocks. A hit of n blocks needs only the
    window's blocks before n * block_size; the chained hash of its first pins the tokens before.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        sliding_window: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be an integer >= 1, got {sliding_window!r}")
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be an integer >= 1, got {max_num_batched_tokens!r}"
            )
        self.sliding_window = sliding_window
        self.max_num_batched_tokens = max_num_batched_tokens

    def max_tokens_in_pool(self) -> int:
        """Unbounded once the pool holds the window before the largest chunk, the chunk and a
        partial block (older blocks are released); else what the pool holds outright."""
        size = self.block_size
        window_and_chunk = -(-(self.sliding_window - 1 + self.max_num_batched_tokens) // size) + 1
        if self.num_usable_blocks >= window_and_chunk:
            return UNBOUNDED_TOKENS
        return self.num_usable_blocks * size

    def _first_needed_block(self, first_position: int) -> int:
        """The first block a query at `first_position` (or later) reads."""
        return max(first_position - self.sliding_window + 1, 0) // self.block_size

    def find_cached_prefix(self, request: Request, max_blocks: int) -> list[int]:
        """The longest n <= max_blocks whose window blocks (those a query at n * block_size
        reads) are all cached: [0] * (first window block) + the window's block ids."""
        size, pool = self.block_size, self.block_pool
        best: list[int] = []
        run_start = 0  # first block of the current run of cached, chained blocks
        run: list[int] = []
        root = parent_entry_id = root_entry_id(request)
        for i in range(max_blocks):
            tokens = request.all_token_ids[i * size : (i + 1) * size]
            block_id = pool.find(request.block_hashes[i], tokens)
            entry = None if block_id is None else pool.entry(block_id)
            if entry is None or (i == 0 and entry.parent_entry_id != root):
                run, run_start = [], i + 1
                continue
            if not run or entry.parent_entry_id != parent_entry_id:
                run, run_start = [], i  # a new run: its first block's parent is not verified
            run.append(block_id)
            parent_entry_id = entry.entry_id
            first = self._first_needed_block((i + 1) * size)
            if first >= run_start:
                best = [NULL_BLOCK_ID] * first + run[first - run_start :]
        return best

    def can_allocate(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int]
    ) -> bool:
        state = self._requests.get(request.req_id)
        if state is not None:
            self._release_out_of_window(state, request.num_computed_tokens)
        return super().can_allocate(request, num_new_tokens, computed_blocks)

    def _nothing_to_do(self, request: Request, state: RequestBlocks, num_new_tokens: int) -> bool:
        return self._first_needed_block(request.num_computed_tokens) <= state.num_released and (
            super()._nothing_to_do(request, state, num_new_tokens)
        )

    def _release_out_of_window(self, state: RequestBlocks, first_position: int) -> None:
        """Releases the held blocks no query from `first_position` on reads, newest first."""
        first = min(self._first_needed_block(first_position), len(state.block_ids))
        if first <= state.num_released:
            return
        released = state.block_ids[state.num_released : first]
        self.block_pool.free(reversed(released))
        state.block_ids[state.num_released : first] = [NULL_BLOCK_ID] * len(released)
        state.num_released = first

    def _check_computed_blocks(
        self, request: Request, num_held_blocks: int, computed_blocks: list[int]
    ) -> None:
        if num_held_blocks or request.num_computed_tokens:
            raise ValueError(
                f"new_computed_blocks are only for a request being admitted; {request.req_id!r} "
                f"holds {num_held_blocks} blocks and {request.num_computed_tokens} computed tokens"
            )
        if len(computed_blocks) > len(request.block_hashes) or computed_blocks != (
            self.find_cached_prefix(request, len(computed_blocks))
        ):
            raise ValueError(
                f"new_computed_blocks {computed_blocks} do not cache the window of the first "
                f"{len(computed_blocks)} blocks of {request.req_id!r}; pass the result of "
                "get_computed_blocks unchanged"
            )
