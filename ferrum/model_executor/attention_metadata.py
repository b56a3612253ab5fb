"""Per-step attention metadata: one object, built by the runner, passed explicitly to the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum.kernels.sdpa_prefill import AttentionSegment


@dataclass(slots=True)
class VerifyStates:
    """How linear-attention layers run a step that verifies drafts (or a verify-shaped CUDA
    graph): the rows with `step_slots[i] >= 0` (their live slot) advance one token at a time
    (`query_len` positions); token j reads the recurrent state of slot `state_slots[i, j]` and
    writes the new one to `state_slots[i, j + 1]` (the live slot from the row's last token on),
    the conv state advances in the live slot and is copied there too. The other rows run as
    chunks over `prefill_slots` (-1 for the rows above; None when there are none)."""

    query_len: int
    step_slots: torch.Tensor  # [num_reqs] int32, on the model's device
    state_slots: torch.Tensor  # [num_reqs, query_len + 1] int32, on the model's device
    prefill_slots: torch.Tensor | None  # [num_reqs] int32, on the model's device


@dataclass(slots=True)
class AttentionMetadata:
    """A flattened batch of `num_tokens` query tokens from `num_reqs` requests. Request i's queries
    `query_start_loc[i]:query_start_loc[i + 1]` are the last tokens of its `seq_lens[i]`-token
    context (causal within the chunk, seeing the cached prefix or its window). Token t's KV goes to
    slot `slot_mapping[g][t]` (block_id * block_size + offset) of every cache of group g before
    attention reads it. `max_query_len` / `max_seq_len` may be upper bounds (CUDA-graph padding)."""

    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [num_reqs] int32, on the model's device
    # Per KV cache group: [num_reqs, max_blocks_per_req] int32, on the model's device.
    block_tables: tuple[torch.Tensor, ...]
    # Per KV cache group: [num_tokens] int64, on the model's device.
    slot_mapping: tuple[torch.Tensor, ...]
    # Host copies, so the SDPA prefill segments never sync on the device tensors.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Where a step with long prompt chunks splits between SDPA and the paged kernel
    # (`kernels/sdpa_prefill.py`); empty otherwise, and in every CUDA-graph step.
    prefill_segments: tuple[AttentionSegment, ...] = ()
    # Layers given FlashAttention-4 run it over this step (`kernels/flash_attn4.py`); never in a
    # CUDA-graph step.
    flash_attention_step: bool = False
    # Set when the step verifies drafts of a model with linear-attention layers.
    verify_states: VerifyStates | None = None
