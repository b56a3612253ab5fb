"""Flattening one step's scheduled tokens into model inputs.

The host side is numpy (built once per step from the runner's request states); the device side
is one `AttentionMetadata` plus token ids and positions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ferrum.model_executor.attention_metadata import AttentionMetadata


class RequestTokens(Protocol):
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # Sampled by launched steps, not yet in token_ids: they follow it, in launch order.
    num_output_placeholders: int


@dataclass(slots=True)
class HostBatch:
    req_ids: list[str]
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: list[int]  # [num_reqs + 1]
    seq_lens: list[int]  # [num_reqs]
    block_tables: np.ndarray  # [num_reqs, max_blocks] int32
    max_query_len: int
    # Flat indices of the tokens whose logits are sampled, and the requests they belong to.
    logits_indices: list[int]
    sampled_req_ids: list[str]
    # Flat indices of input tokens not yet on the host (sampled by the previous launched step,
    # input_ids holds 0 there), and their requests: filled on the device before the forward.
    placeholder_indices: list[int]
    placeholder_req_ids: list[str]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(slots=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor


def build_host_batch(
    requests: Mapping[str, RequestTokens],
    num_scheduled_tokens: Mapping[str, int],
    num_tokens: int,
    block_size: int,
) -> HostBatch:
    """Request i's tokens [computed, computed + scheduled) in scheduling order, with their slots.

    A decode whose input is its pending token (the one the previous launched step samples) gets
    a placeholder; prompt chunks only ever cover known tokens."""
    req_ids = list(num_scheduled_tokens)
    num_reqs = len(req_ids)
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    query_start_loc = [0] * (num_reqs + 1)
    seq_lens = [0] * num_reqs
    max_blocks = max(len(requests[r].block_ids) for r in req_ids)
    block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
    logits_indices: list[int] = []
    sampled_req_ids: list[str] = []
    placeholder_indices: list[int] = []
    placeholder_req_ids: list[str] = []
    offset = 0
    for i, req_id in enumerate(req_ids):
        state = requests[req_id]
        n = num_scheduled_tokens[req_id]
        start = state.num_computed_tokens
        end = start + n
        block_ids = state.block_ids
        block_tables[i, : len(block_ids)] = block_ids
        num_known = len(state.token_ids)
        if n == 1:  # the decode fast path: plain ints, no temporary arrays
            if start < num_known:
                input_ids[offset] = state.token_ids[start]
            else:
                assert start == num_known and state.num_output_placeholders, (req_id, start)
                input_ids[offset] = 0
                placeholder_indices.append(offset)
                placeholder_req_ids.append(req_id)
            positions[offset] = start
            slot_mapping[offset] = block_ids[start // block_size] * block_size + start % block_size
        else:
            assert end <= num_known, (req_id, end, num_known)
            input_ids[offset : offset + n] = state.token_ids[start:end]
            pos = np.arange(start, end, dtype=np.int64)
            positions[offset : offset + n] = pos
            blocks = np.asarray(block_ids, dtype=np.int64)
            slot_mapping[offset : offset + n] = blocks[pos // block_size] * block_size + (
                pos % block_size
            )
        offset += n
        query_start_loc[i + 1] = offset
        seq_lens[i] = end
        if end == num_known + state.num_output_placeholders:
            logits_indices.append(offset - 1)
            sampled_req_ids.append(req_id)
    return HostBatch(
        req_ids=req_ids,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=max(num_scheduled_tokens.values()),
        logits_indices=logits_indices,
        sampled_req_ids=sampled_req_ids,
        placeholder_indices=placeholder_indices,
        placeholder_req_ids=placeholder_req_ids,
    )


def to_device_inputs(
    batch: HostBatch, device: torch.device, split_kv_workspace: Any = None
) -> BatchInputs:
    def to_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    metadata = AttentionMetadata(
        num_reqs=batch.num_reqs,
        num_tokens=len(batch.input_ids),
        max_query_len=batch.max_query_len,
        max_seq_len=max(batch.seq_lens),
        query_start_loc=to_device(np.asarray(batch.query_start_loc, dtype=np.int32)),
        seq_lens=to_device(np.asarray(batch.seq_lens, dtype=np.int32)),
        block_tables=to_device(batch.block_tables),
        slot_mapping=to_device(batch.slot_mapping),
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
        split_kv_workspace=split_kv_workspace,
    )
    return BatchInputs(
        input_ids=to_device(batch.input_ids),
        positions=to_device(batch.positions),
        attn_metadata=metadata,
        logits_indices=to_device(np.asarray(batch.logits_indices, dtype=np.int64)),
    )


def profile_batch(seq_lens: list[int], block_size: int) -> HostBatch:
    """Prompts of the given lengths on consecutive blocks from block 1, all token id 0."""
    num_tokens = sum(seq_lens)
    query_start_loc = [0]
    for n in seq_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    block_tables = np.zeros((len(seq_lens), max_blocks), dtype=np.int32)
    slot_mapping, positions = [], []
    next_block = 1
    for i, n in enumerate(seq_lens):
        num_blocks = -(-n // block_size)
        block_tables[i, :num_blocks] = np.arange(next_block, next_block + num_blocks)
        slot_mapping.extend(range(next_block * block_size, next_block * block_size + n))
        positions.extend(range(n))
        next_block += num_blocks
    return HostBatch(
        req_ids=[str(i) for i in range(len(seq_lens))],
        input_ids=np.zeros(num_tokens, dtype=np.int64),
        positions=np.asarray(positions, dtype=np.int64),
        slot_mapping=np.asarray(slot_mapping, dtype=np.int64),
        query_start_loc=query_start_loc,
        seq_lens=list(seq_lens),
        block_tables=block_tables,
        max_query_len=max(seq_lens),
        logits_indices=[],
        sampled_req_ids=[],
        placeholder_indices=[],
        placeholder_req_ids=[],
    )
