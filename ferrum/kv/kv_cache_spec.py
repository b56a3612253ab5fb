"""Layer groups of the KV cache: layers of one attention kind share a block pool and a table per
request, each keeping its own cache tensor over that pool. Full attention keeps every block;
sliding window W (p reads p - W < k <= p) releases blocks out of every future window; recurrent
layers (gated DeltaNet) keep one state slot per request, its id heading a table of null blocks as
long as the other groups' tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    # Decoder layer indices of the group, increasing.
    layer_ids: tuple[int, ...]
    # None: full attention; else each query reads its last `sliding_window` positions.
    sliding_window: int | None = None
    # Linear-attention layers: one state slot per request instead of KV blocks.
    recurrent: bool = False

    def max_blocks_per_request(self, num_tokens: int, max_chunk: int, block_size: int) -> int:
        """The most blocks a request of up to `num_tokens` tokens holds at once, computing at most
        `max_chunk` tokens per step: all of them with full attention; the window before the
        chunk, the chunk and one partial block with a sliding window."""
        if self.recurrent:
            return 1
        all_blocks = -(-num_tokens // block_size)
        if self.sliding_window is None:
            return all_blocks
        window_blocks = -(-(self.sliding_window - 1 + min(max_chunk, num_tokens)) // block_size)
        return min(all_blocks, window_blocks + 1)


def kv_cache_groups(
    layer_windows: Sequence[int | None], recurrent_layers: Sequence[int] = ()
) -> tuple[KVCacheGroupSpec, ...]:
    """One group per distinct window (None = full attention), full attention first, then by
    increasing window, then the recurrent layers' group. `layer_windows[i]` is layer i's
    sliding window or None; it is not read for the layers in `recurrent_layers`."""
    recurrent = set(recurrent_layers)
    attention = [(i, w) for i, w in enumerate(layer_windows) if i not in recurrent]
    if not attention:
        raise ValueError("layer_windows: a model needs at least one attention layer")
    windows = sorted({w for _, w in attention}, key=lambda w: (w is not None, w or 0))
    groups = [
        KVCacheGroupSpec(tuple(i for i, w in attention if w == window), window)
        for window in windows
    ]
    if recurrent:
        groups.append(KVCacheGroupSpec(tuple(sorted(recurrent)), recurrent=True))
    return tuple(groups)


def layer_group_ids(groups: Sequence[KVCacheGroupSpec]) -> list[int]:
    """The group index of each decoder layer."""
    ids = {layer: g for g, group in enumerate(groups) for layer in group.layer_ids}
    return [ids[layer] for layer in range(len(ids))]
