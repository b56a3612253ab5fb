"""The linear-attention state slots of a runner's KV caches: a request's slot is zeroed when it
starts from its first token, filled from a snapshot on a prefix hit, and copied into a snapshot
slot after a chunk that ends on a block holding one; after a step that verified drafts, the state
after each request's last accepted token becomes its live state (`verify_states.py`). A layer's
states are a (conv, recurrent) pair of pools indexed by slot; every copy is queued on the device,
all reads before any write. Without linear-attention layers every method returns."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ferrum.kv.kv_cache_spec import KVCacheGroupSpec
    from ferrum.model_executor.runner_state import CachedRequestState
    from ferrum.model_executor.verify_states import VerifyStateLayout
    from ferrum.scheduler.output import NewRequestData


class RecurrentStateCache:
    def __init__(
        self, kv_cache_groups: Sequence[KVCacheGroupSpec], block_size: int, device: torch.device
    ) -> None:
        # The KV cache groups of linear-attention layers: entry 0 of a request's table there is
        # its live state slot, a later nonzero entry a snapshot slot.
        self.groups = [g for g, spec in enumerate(kv_cache_groups) if spec.recurrent]
        self.block_size = block_size
        self.device = device
        self._pools: list[torch.Tensor] = []

    def bind(self, kv_caches: Iterable[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Takes the state pools of the linear-attention layers' caches (none: unbinds)."""
        self._pools = [pool for cache in kv_caches if isinstance(cache, tuple) for pool in cache]

    def start_requests(self, new_reqs: Iterable[NewRequestData]) -> None:
        """Before the step's forward: zeroes the slot of each new request that starts from its
        first token (a slot's previous owner left its state there) and copies into a prefix
        hit's slot the snapshot that ends its hit."""
        if not self.groups:
            return
        fresh: list[int] = []
        src: list[int] = []
        dst: list[int] = []
        for new in new_reqs:
            for g in self.groups:
                table = new.block_ids[g]
                if new.num_computed_tokens == 0:
                    fresh.append(table[0])
                else:
                    src.append(table[new.num_computed_tokens // self.block_size - 1])
                    dst.append(table[0])
        if fresh:
            index = torch.tensor(fresh, dtype=torch.int64).to(self.device, non_blocking=True)
            for pool in self._pools:
                pool.index_fill_(0, index, 0)
        self._copy(src, dst)

    def snapshot(
        self,
        requests: Mapping[str, CachedRequestState],
        num_scheduled: Mapping[str, int],
        drafts: Mapping[str, list[int]],
    ) -> None:
        """After the step's forward, before `num_computed_tokens` advance: each chunk that ended
        on a block whose table entry holds a snapshot slot gets its live state copied there. A
        chunk with drafts never does: its live state may hold rejected ones (and its end, past
        the known tokens, never gets a snapshot slot from the scheduler)."""
        if not self.groups:
            return
        block_size = self.block_size
        src: list[int] = []
        dst: list[int] = []
        for req_id, n in num_scheduled.items():
            if drafts.get(req_id):
                continue
            state = requests[req_id]
            start = state.num_computed_tokens
            end = start + n
            if end % block_size or start > end - block_size:
                continue
            for g in self.groups:
                table = state.block_ids[g]
                index = end // block_size - 1
                if 1 <= index < len(table) and table[index]:
                    src.append(table[0])
                    dst.append(table[index])
        self._copy(src, dst)

    def roll_back(
        self,
        states: Sequence[CachedRequestState],
        drafts: Sequence[list[int]],
        emitted: Sequence[list[int]],
        live: Sequence[bool],
        layout: VerifyStateLayout,
    ) -> None:
        """After a verify step completed (before the next launches): each live request that
        emitted fewer than len(drafts[i]) + 1 tokens (a draft rejected) gets the state after
        its last accepted token, kept in its scratch slot, copied into its live slot. Its row
        among the step's requests with drafts numbers its scratch slots, as at launch."""
        if not self.groups:
            return
        assert len(self.groups) == 1, "one linear-attention group numbers the scratch slots"
        src: list[int] = []
        dst: list[int] = []
        row = 0
        for state, row_drafts, tokens, is_live in zip(states, drafts, emitted, live, strict=True):
            if not row_drafts:
                continue
            accepted = len(tokens) - 1
            if is_live and accepted < len(row_drafts):
                src.append(layout.scratch_slot(row, accepted))
                dst.append(state.block_ids[self.groups[0]][0])
            row += 1
        self._copy(src, dst)

    def _copy(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Copies the states of slots `src_slots[i]` to `dst_slots[i]` in every layer."""
        if not src_slots:
            return
        src = torch.tensor(src_slots, dtype=torch.int64).to(self.device, non_blocking=True)
        dst = torch.tensor(dst_slots, dtype=torch.int64).to(self.device, non_blocking=True)
        for pool in self._pools:
            pool.index_copy_(0, dst, pool.index_select(0, src))
