"""The linear-attention state slots of a runner's KV caches: zeroing a request's fresh slot,
copying slots (prefix-cache hits and snapshots), and which snapshots a step's chunks take.

A linear-attention layer's cache is a (conv state, recurrent state) pair of pools indexed by slot;
every copy is queued on the device, all reads before any write."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ferrum.model_executor.runner_state import CachedRequestState

KVCaches = Sequence["torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def reset_recurrent_slots(kv_caches: KVCaches, slot_ids: list[int], device: torch.device) -> None:
    """Zeroes the state slots of requests starting from their first token (a slot's previous
    owner left its state there), queued before the step's forward."""
    if not slot_ids:
        return
    index = torch.tensor(slot_ids, dtype=torch.int64).to(device, non_blocking=True)
    for cache in kv_caches:
        if isinstance(cache, tuple):
            for pool in cache:
                pool.index_fill_(0, index, 0)


def copy_recurrent_slots(
    kv_caches: KVCaches, src_slots: list[int], dst_slots: list[int], device: torch.device
) -> None:
    """Copies the states of slots `src_slots[i]` to `dst_slots[i]` in every layer."""
    if not src_slots:
        return
    src = torch.tensor(src_slots, dtype=torch.int64).to(device, non_blocking=True)
    dst = torch.tensor(dst_slots, dtype=torch.int64).to(device, non_blocking=True)
    for cache in kv_caches:
        if isinstance(cache, tuple):
            for pool in cache:
                pool.index_copy_(0, dst, pool.index_select(0, src))


def snapshot_copies(
    requests: Mapping[str, CachedRequestState],
    num_scheduled: Mapping[str, int],
    block_size: int,
    recurrent_groups: Sequence[int],
) -> tuple[list[int], list[int]]:
    """(live slots, snapshot slots) to copy after a step's forward: each chunk that ended on a
    block boundary whose state-group table entry holds a snapshot slot (before the chunk's
    `num_computed_tokens` advance)."""
    src: list[int] = []
    dst: list[int] = []
    for req_id, n in num_scheduled.items():
        state = requests[req_id]
        start = state.num_computed_tokens
        end = start + n
        if end % block_size or start > end - block_size:
            continue
        for g in recurrent_groups:
            table = state.block_ids[g]
            index = end // block_size - 1
            if 1 <= index < len(table) and table[index]:
                src.append(table[0])
                dst.append(table[index])
    return src, dst
