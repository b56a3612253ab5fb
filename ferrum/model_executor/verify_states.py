"""The linear-attention state slots of a step that verifies drafts (`VerifyStates`). A runner of a
model with linear-attention layers keeps `verify_scratch_slots` slots past the KV manager's in
every such layer's pools, k per verifying request: the r-th request with drafts in a step (in
scheduling order) keeps the state after its token j (its next token, then each draft but the
last) in slot `scratch_base + r * k + j`, and its live slot ends after its last draft. Once the
step's acceptance is known, the state after its last accepted token becomes the live one
(`RecurrentStateCache.roll_back`), so no state that saw a rejected draft survives the step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ferrum.config import EngineConfig
from ferrum.kv.kv_cache_spec import KVCacheGroupSpec
from ferrum.model_executor.attention_metadata import VerifyStates
from ferrum.model_executor.staging_buffer import StagingBuffer, staging_bytes
from ferrum.speculative_config import verify_scratch_slots


@dataclass(frozen=True)
class VerifyStateLayout:
    recurrent_group: int  # the KV cache group of the linear-attention layers
    num_speculative_tokens: int
    scratch_base: int  # the KV manager's slot count: the scratch slots follow it

    @property
    def query_len(self) -> int:
        return 1 + self.num_speculative_tokens

    def scratch_slot(self, row: int, position: int) -> int:
        """Where the r-th verifying request of a step keeps its state after token `position`."""
        return self.scratch_base + row * self.num_speculative_tokens + position

    def is_verify_shape(self, pad_to: tuple[int, int] | None) -> bool:
        """Whether a CUDA graph of shape (tokens, requests) is a verify graph's."""
        if pad_to is None:
            return False
        num_tokens, num_rows = pad_to
        return num_tokens != num_rows and num_tokens == num_rows * self.query_len


def verify_staging_bytes(max_num_reqs: int, query_len: int) -> int:
    """What `build_verify_states` takes of a step's staging buffer at most."""
    return staging_bytes(
        (max_num_reqs, torch.int32),
        (max_num_reqs * (query_len + 1), torch.int32),
        (max_num_reqs, torch.int32),
    )


def build_verify_states(
    staging: StagingBuffer,
    layout: VerifyStateLayout,
    requests: Mapping[str, object],
    num_scheduled_tokens: Mapping[str, int],
    drafts: Mapping[str, list[int]],
    pad_to: tuple[int, int] | None,
) -> VerifyStates | None:
    """The step's `VerifyStates` (None when it verifies no drafts and is no verify graph). In a
    verify graph every row, padding included, advances one token at a time (a row without
    drafts in its live slot only); an eager step does so for its rows with drafts only."""
    graph = layout.is_verify_shape(pad_to)
    draft_counts = [len(drafts.get(req_id, ())) for req_id in num_scheduled_tokens]
    if not graph and not any(draft_counts):
        return None
    if graph:
        assert pad_to is not None
        num_rows, query_len = pad_to[1], pad_to[0] // pad_to[1]
    else:
        num_rows, query_len = len(draft_counts), 1 + max(draft_counts)
    step_np, step_slots = staging.take(num_rows, torch.int32)
    chain_np, state_slots = staging.take(num_rows * (query_len + 1), torch.int32)
    chain_np = chain_np.reshape(num_rows, query_len + 1)
    step_np[:] = 0  # padding rows: the null slot
    chain_np[:] = 0
    prefill_np, prefill_slots = None, None
    if not graph and not all(draft_counts):
        prefill_np, prefill_slots = staging.take(num_rows, torch.int32)
    group, row = layout.recurrent_group, 0
    for i, (req_id, n) in enumerate(zip(num_scheduled_tokens, draft_counts)):
        live = requests[req_id].block_ids[group][0]  # type: ignore[attr-defined]
        per_position = graph or n > 0
        step_np[i] = live if per_position else -1
        if prefill_np is not None:
            prefill_np[i] = -1 if per_position else live
        if per_position:  # live -> scratch (row, 0) .. (row, n - 1) -> live, then live
            chain_np[i] = live
            chain_np[i, 1 : n + 1] = [layout.scratch_slot(row, j) for j in range(n)]
            row += 1 if n else 0
    return VerifyStates(
        query_len, step_slots, state_slots.view(num_rows, query_len + 1), prefill_slots
    )


def verify_state_layout(
    config: EngineConfig, groups: Sequence[KVCacheGroupSpec], counts: Sequence[int]
) -> VerifyStateLayout | None:
    """The layout of a runner whose pools hold `counts` slots per group before the scratch
    slots; None without speculative decoding or linear-attention layers."""
    spec = config.speculative_config
    recurrent = [g for g, group in enumerate(groups) if group.recurrent]
    if spec is None or not recurrent:
        return None
    assert len(recurrent) == 1, "one KV cache group holds every linear-attention layer"
    return VerifyStateLayout(recurrent[0], spec.num_speculative_tokens, counts[recurrent[0]])


def with_scratch_slots(
    config: EngineConfig, groups: Sequence[KVCacheGroupSpec], counts: Sequence[int]
) -> list[int]:
    """`counts` with the linear-attention group's grown by `verify_scratch_slots`."""
    scratch = verify_scratch_slots(
        config.scheduler_config.max_num_seqs,
        config.speculative_config,
        config.model_config.arch,
    )
    return [n + scratch if group.recurrent else n for n, group in zip(counts, groups, strict=True)]
