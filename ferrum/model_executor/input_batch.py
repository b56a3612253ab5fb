"""Flattening one step's scheduled tokens into model inputs, in buffers sized once at start-up.

Per step, one host->device copy carries input_ids, positions and each KV cache group's
slot_mapping (one entry per token), query_start_loc, seq_lens and each group's block_tables (one
row per request), then the indices of the sampled tokens and of the placeholders. A CUDA-graph batch is padded to the graph's shape, and
its block tables are `max_blocks_per_req` wide: equal shapes give equal offsets, so a replay reads
the same addresses its capture did. An eager batch's block tables are as wide as its longest.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ferrum.kernels.sdpa_prefill import (
    PREFIX_PER_CHUNK,
    long_chunk_in_step,
    long_prefill_segments,
)
from ferrum.model_executor.attention_metadata import AttentionMetadata
from ferrum.model_executor.staging_buffer import StagingBuffer, staging_bytes


class RequestTokens(Protocol):
    token_ids: list[int]
    # One block table per KV cache group, all of the same length.
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    # Sampled by launched steps, not yet in token_ids: they follow it, in launch order.
    num_output_placeholders: int


@dataclass(slots=True)
class StepInputs:
    """One step's batch: device views into the input buffers plus what the runner needs next."""

    input_ids: torch.Tensor  # [num_tokens (padded)] int64
    positions: torch.Tensor  # [num_tokens (padded)] int64
    attn_metadata: AttentionMetadata
    # Rows of the hidden states to sample, in batch order; None when that is every real token.
    logits_indices: torch.Tensor | None
    sampled_req_ids: list[str]
    # Input tokens the previous launched step samples (input_ids holds 0 there): the runner sets
    # input_ids[index[0]] = last_sampled[index[1]] with index [2, num_placeholders], or copies
    # the first num_placeholders of last_sampled to the first of input_ids when index is None.
    num_placeholders: int
    placeholder_index: torch.Tensor | None


@dataclass(slots=True)
class _ProfileRequest:
    token_ids: list[int]
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0


def profile_batch(
    seq_lens: list[int],
    block_size: int,
    num_kv_groups: int = 1,
    recurrent_groups: Collection[int] = (),
) -> tuple[dict[str, RequestTokens], dict[str, int]]:
    """Whole prompts of the given lengths on consecutive blocks from block 1 (the same in every
    KV cache group; request i has state slot i + 1 in the `recurrent_groups`), all token id 0:
    the requests and their scheduled tokens."""
    requests: dict[str, RequestTokens] = {}
    next_block = 1
    for i, n in enumerate(seq_lens):
        num_blocks = -(-n // block_size)
        block_ids = list(range(next_block, next_block + num_blocks))
        slot_table = [i + 1] + [0] * (num_blocks - 1)
        requests[str(i)] = _ProfileRequest(
            [0] * n,
            tuple(
                list(slot_table if g in recurrent_groups else block_ids)
                for g in range(num_kv_groups)
            ),
        )
        next_block += num_blocks
    return requests, {req_id: len(r.token_ids) for req_id, r in requests.items()}


class InputBuffers:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        num_kv_groups: int = 1,
        sdpa_max_len: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        # The longest context a chunk attends over through SDPA: start-up builds cuDNN's plans up
        # to it (`warm_up.py`); None: min(max_num_tokens, max_model_len).
        self.sdpa_max_len = (
            min(max_num_tokens, max_model_len) if sdpa_max_len is None else sdpa_max_len
        )
        # The longest cached prefix, in chunks, before a chunk that SDPA takes; start-up sets 0
        # where cuDNN does not take a layer's shape (`sdpa_prefill.cudnn_takes`).
        self.sdpa_prefix_per_chunk = PREFIX_PER_CHUNK
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.num_kv_groups = num_kv_groups
        num_bytes = staging_bytes(
            *[(max_num_tokens, torch.int64)] * (2 + num_kv_groups),
            (max_num_reqs + 1, torch.int32),
            (max_num_reqs, torch.int32),
            *[(max_num_reqs * self.max_blocks_per_req, torch.int32)] * num_kv_groups,
            (max_num_reqs, torch.int64),
            (2 * max_num_reqs, torch.int64),
        )
        self._staging = StagingBuffer(num_bytes, device)

    def prepare(
        self,
        requests: Mapping[str, RequestTokens],
        num_scheduled_tokens: Mapping[str, int],
        num_tokens: int,
        last_sampled_rows: Mapping[str, int],
        pad_to: tuple[int, int] | None = None,
    ) -> StepInputs:
        """Request i's tokens [computed, computed + scheduled) in scheduling order, with their
        slots, queued to the device. A decode whose input is its pending token (sampled by the
        previous launched step, at row `last_sampled_rows[req_id]` of its output) gets a
        placeholder; prompt chunks only ever cover known tokens.

        `pad_to` = (tokens, requests) of a CUDA graph: padding requests get one token each at
        position 0 over a one-token context in block 0 (never handed out), further padding
        tokens belong to no request; both write their KV to slot 0."""
        block_size = self.block_size
        req_ids = list(num_scheduled_tokens)
        num_reqs = len(req_ids)
        if pad_to is None:
            num_padded, num_rows = num_tokens, num_reqs
            width = max(len(requests[r].block_ids[0]) for r in req_ids)
        else:
            (num_padded, num_rows), width = pad_to, self.max_blocks_per_req
        take = self._staging.take
        self._staging.begin()
        input_ids_np, input_ids = take(num_padded, torch.int64)
        positions_np, positions = take(num_padded, torch.int64)
        groups = range(self.num_kv_groups)
        slot_mappings = [take(num_padded, torch.int64) for _ in groups]
        query_start_loc_np, query_start_loc = take(num_rows + 1, torch.int32)
        seq_lens_np, seq_lens = take(num_rows, torch.int32)
        block_tables = [take(num_rows * width, torch.int32) for _ in groups]
        tables_np = [table_np.reshape(num_rows, width) for table_np, _ in block_tables]
        slot_nps = [slot_np for slot_np, _ in slot_mappings]
        # The common single-group case fills its one table and slot array without a loop.
        single_group = len(tables_np) == 1
        table_np0, slot_np0 = tables_np[0], slot_nps[0]
        query_start_loc_list = [0] * (num_reqs + 1)
        seq_lens_list = [0] * num_reqs
        logits_indices: list[int] = []
        sampled_req_ids: list[str] = []
        placeholder_indices: list[int] = []
        placeholder_rows: list[int] = []
        offset = 0
        for i, req_id in enumerate(req_ids):
            state = requests[req_id]
            n = num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + n
            group_block_ids = state.block_ids
            # Entries past a row's context are never read, so stale ones need no clearing.
            if single_group:
                table_np0[i, : len(group_block_ids[0])] = group_block_ids[0]
            else:
                for table_np, block_ids in zip(tables_np, group_block_ids):
                    table_np[i, : len(block_ids)] = block_ids
            num_known = len(state.token_ids)
            if n == 1:  # the decode fast path: plain ints, no temporary arrays
                if start < num_known:
                    input_ids_np[offset] = state.token_ids[start]
                else:
                    assert start == num_known and state.num_output_placeholders, (req_id, start)
                    input_ids_np[offset] = 0
                    placeholder_indices.append(offset)
                    placeholder_rows.append(last_sampled_rows[req_id])
                positions_np[offset] = start
                block_index, block_offset = divmod(start, block_size)
                if single_group:
                    slot_np0[offset] = group_block_ids[0][block_index] * block_size + block_offset
                else:
                    for slot_np, block_ids in zip(slot_nps, group_block_ids):
                        slot_np[offset] = block_ids[block_index] * block_size + block_offset
            else:
                assert end <= num_known, (req_id, end, num_known)
                input_ids_np[offset : offset + n] = state.token_ids[start:end]
                pos = np.arange(start, end, dtype=np.int64)
                positions_np[offset : offset + n] = pos
                block_index, block_offset = pos // block_size, pos % block_size
                for slot_np, block_ids in zip(slot_nps, group_block_ids):
                    blocks = np.asarray(block_ids, dtype=np.int64)
                    slot_np[offset : offset + n] = blocks[block_index] * block_size + block_offset
            offset += n
            query_start_loc_list[i + 1] = offset
            seq_lens_list[i] = end
            if end == num_known + state.num_output_placeholders:
                logits_indices.append(offset - 1)
                sampled_req_ids.append(req_id)
        query_start_loc_np[: num_reqs + 1] = query_start_loc_list
        seq_lens_np[:num_reqs] = seq_lens_list
        if pad_to is not None:
            for array in (input_ids_np, positions_np, *slot_nps):
                array[num_tokens:] = 0
            query_start_loc_np[num_reqs + 1 :] = np.arange(
                num_tokens + 1, num_tokens + 1 + num_rows - num_reqs
            )
            seq_lens_np[num_reqs:] = 1
            for table_np in tables_np:
                table_np[num_reqs:, 0] = 0
        logits_index = None
        if len(logits_indices) < num_tokens:
            logits_np, logits_index = take(len(logits_indices), torch.int64)
            logits_np[:] = logits_indices
        num_placeholders = len(placeholder_indices)
        placeholder_index = None
        # The steady decode batch (same requests, same order as the previous step) needs none.
        if num_placeholders and (
            placeholder_indices[-1] != num_placeholders - 1
            or placeholder_rows != list(range(num_placeholders))
        ):
            index_np, placeholder_index = take(2 * num_placeholders, torch.int64)
            index_np[:num_placeholders] = placeholder_indices
            index_np[num_placeholders:] = placeholder_rows
            placeholder_index = placeholder_index.view(2, num_placeholders)
        self._staging.copy()
        if pad_to is None:
            max_query_len, max_seq_len = max(num_scheduled_tokens.values()), max(seq_lens_list)
        else:  # the bounds a graph is captured for
            max_query_len = 1 if num_padded == num_rows else num_padded
            max_seq_len = self.max_model_len
        metadata = AttentionMetadata(
            num_reqs=num_rows,
            num_tokens=num_padded,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=tuple(table.view(num_rows, width) for _, table in block_tables),
            slot_mapping=tuple(mapping for _, mapping in slot_mappings),
            query_start_loc_cpu=query_start_loc_list,
            seq_lens_cpu=seq_lens_list,
            prefill_segments=(
                long_prefill_segments(
                    query_start_loc_list,
                    seq_lens_list,
                    self.sdpa_max_len,
                    self.sdpa_prefix_per_chunk,
                )
                if pad_to is None and long_chunk_in_step(max_query_len)
                else ()
            ),
        )
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            attn_metadata=metadata,
            logits_indices=logits_index,
            sampled_req_ids=sampled_req_ids,
            num_placeholders=num_placeholders,
            placeholder_index=placeholder_index,
        )
