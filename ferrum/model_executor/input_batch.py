"""Flattening one step's scheduled tokens into model inputs, in buffers sized once at start-up.
One host->device copy per step carries input_ids, positions and each KV cache group's
slot_mapping (per token), query_start_loc, seq_lens and each group's block_tables (per request),
then the indices of the sampled tokens and of the placeholders. A CUDA-graph batch is padded to
the graph's shape with `max_blocks_per_req`-wide tables: equal shapes give equal offsets, so a
replay reads the addresses its capture did. An eager batch's tables are as wide as its longest."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ferrum.config import EngineConfig
from ferrum.kernels.flash_attn4 import flash_attention_step
from ferrum.kernels.sdpa_prefill import (
    PREFIX_PER_CHUNK,
    long_chunk_in_step,
    long_prefill_segments,
)
from ferrum.model_executor.attention_metadata import AttentionMetadata
from ferrum.model_executor.staging_buffer import StagingBuffer, staging_bytes
from ferrum.model_executor.verify_states import (
    VerifyStateLayout,
    build_verify_states,
    verify_staging_bytes,
)
from ferrum.speculative_config import verify_scratch_slots


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
        verify_query_len: int = 0,
    ) -> None:
        """`verify_query_len` > 0: room for a verifying step's `VerifyStates` (linear-attention
        layers with speculative decoding), built once `verify_layout` is set."""
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_tokens
        # The longest context a chunk attends over through SDPA: start-up builds cuDNN's plans up
        # to it (`warm_up.py`); None: min(max_num_tokens, max_model_len).
        self.sdpa_max_len = (
            min(max_num_tokens, max_model_len) if sdpa_max_len is None else sdpa_max_len
        )
        # The longest cached prefix, in chunks, before a chunk that SDPA takes; start-up sets 0
        # where cuDNN does not take a layer's shape (`sdpa_prefill.cudnn_takes`).
        self.sdpa_prefix_per_chunk = PREFIX_PER_CHUNK
        # Whether steps are marked for FlashAttention-4 (`flash_attention_step`): set by the
        # runner where a layer took it; off, an eager step skips the per-request count.
        self.marks_flash_attention = False
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
        if verify_query_len:
            num_bytes += verify_staging_bytes(max_num_reqs, verify_query_len)
        self._staging = StagingBuffer(num_bytes, device)
        self.verify_layout: VerifyStateLayout | None = None

    @classmethod
    def for_config(
        cls, config: EngineConfig, num_kv_groups: int, device: torch.device
    ) -> InputBuffers:
        """Buffers for the largest step: a batch, a padded CUDA-graph batch or the memory
        profile."""
        sched, max_model_len = config.scheduler_config, config.model_config.max_model_len
        spec, arch = config.speculative_config, config.model_config.arch
        scratch = verify_scratch_slots(sched.max_num_seqs, spec, arch)
        return cls(
            max_num_tokens=max(sched.max_num_batched_tokens, min(sched.max_num_seqs, 512)),
            max_num_reqs=max(sched.max_num_seqs, -(-sched.max_num_batched_tokens // max_model_len)),
            max_model_len=max_model_len,
            block_size=config.cache_config.block_size,
            device=device,
            num_kv_groups=num_kv_groups,
            sdpa_max_len=min(sched.max_num_batched_tokens, max_model_len),
            verify_query_len=1 + spec.num_speculative_tokens if scratch and spec else 0,
        )

    def prepare(
        self,
        requests: Mapping[str, RequestTokens],
        num_scheduled_tokens: Mapping[str, int],
        num_tokens: int,
        last_sampled_rows: Mapping[str, int],
        pad_to: tuple[int, int] | None = None,
        drafts: Mapping[str, list[int]] | None = None,
    ) -> StepInputs:
        """Request i's tokens [computed, computed + scheduled) in scheduling order, with their
        slots, queued to the device. A decode whose input is its pending token (sampled by the
        previous launched step, at row `last_sampled_rows[req_id]` of its output) gets a
        placeholder; prompt chunks only ever cover known tokens. `pad_to` = (tokens, requests)
        of a CUDA graph: padding requests get one token at position 0 over a one-token context
        in block 0 (never handed out), further padding tokens none; all write KV to slot 0.
        `drafts`: a request's last tokens (already in its token_ids) are drafts, and the step
        samples after each of them as well as after the token before them."""
        req_ids = list(num_scheduled_tokens)
        if pad_to is None:
            num_padded, num_rows = num_tokens, len(req_ids)
            width = max(len(requests[r].block_ids[0]) for r in req_ids)
        else:
            (num_padded, num_rows), width = pad_to, self.max_blocks_per_req
        self._staging.begin()
        step = _StepBuffers.take(self._staging, num_padded, num_rows, width, self.num_kv_groups)
        # Taken before any array of a data-dependent size: a graph's replay reads its capture's.
        verify_states = None
        if self.verify_layout is not None:
            verify_states = build_verify_states(
                self._staging,
                self.verify_layout,
                requests,
                num_scheduled_tokens,
                drafts or {},
                pad_to,
            )
        rows = _fill_rows(
            step, requests, num_scheduled_tokens, last_sampled_rows, self.block_size, drafts or {}
        )
        if pad_to is not None:
            step.pad(num_tokens, len(req_ids), num_rows)
        logits_index = None
        if len(rows.logits_indices) < num_tokens:
            logits_np, logits_index = self._staging.take(len(rows.logits_indices), torch.int64)
            logits_np[:] = rows.logits_indices
        placeholder_index = self._placeholder_index(rows)
        self._staging.copy()
        if pad_to is None:
            max_query_len, max_seq_len = max(num_scheduled_tokens.values()), max(rows.seq_lens)
        else:  # the bounds a graph is captured for (a verify graph's: tokens / requests)
            max_query_len = num_padded if num_rows == 1 else num_padded // num_rows
            max_seq_len = self.max_model_len
        metadata = AttentionMetadata(
            num_reqs=num_rows,
            num_tokens=num_padded,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=step.query_start_loc,
            seq_lens=step.seq_lens,
            block_tables=tuple(table.view(num_rows, width) for table in step.block_tables),
            slot_mapping=step.slot_mappings,
            query_start_loc_cpu=rows.query_start_loc,
            seq_lens_cpu=rows.seq_lens,
            verify_states=verify_states,
        )
        if pad_to is None and max_query_len > 1:  # how an eager step's prompt chunks attend
            self._mark_prompt_attention(metadata)
        return StepInputs(
            input_ids=step.input_ids,
            positions=step.positions,
            attn_metadata=metadata,
            logits_indices=logits_index,
            sampled_req_ids=rows.sampled_req_ids,
            num_placeholders=len(rows.placeholder_indices),
            placeholder_index=placeholder_index,
        )

    def _mark_prompt_attention(self, metadata: AttentionMetadata) -> None:
        """The SDPA segments of a step with long chunks, and whether it is FlashAttention-4's
        (`kernels/sdpa_prefill.py`, `kernels/flash_attn4.py`)."""
        starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        if long_chunk_in_step(metadata.max_query_len):
            metadata.prefill_segments = long_prefill_segments(
                starts, seq_lens, self.sdpa_max_len, self.sdpa_prefix_per_chunk
            )
        if self.marks_flash_attention:
            metadata.flash_attention_step = flash_attention_step(starts, seq_lens)

    def _placeholder_index(self, rows: _Rows) -> torch.Tensor | None:
        """[2, n]: each placeholder's input position and its row in the last sampled tokens;
        None for the steady decode batch (same requests, same order as the previous step)."""
        indices, sampled_rows = rows.placeholder_indices, rows.placeholder_rows
        n = len(indices)
        if not n or (indices[-1] == n - 1 and sampled_rows == list(range(n))):
            return None
        index_np, index = self._staging.take(2 * n, torch.int64)
        index_np[:n] = indices
        index_np[n:] = sampled_rows
        return index.view(2, n)


@dataclass(slots=True)
class _StepBuffers:
    """One step's slices of the staging buffer: host arrays to fill, device views to read."""

    input_ids_np: np.ndarray
    input_ids: torch.Tensor
    positions_np: np.ndarray
    positions: torch.Tensor
    slot_nps: list[np.ndarray]
    slot_mappings: tuple[torch.Tensor, ...]
    query_start_loc_np: np.ndarray
    query_start_loc: torch.Tensor
    seq_lens_np: np.ndarray
    seq_lens: torch.Tensor
    tables_np: list[np.ndarray]  # [num_rows, width] each
    block_tables: list[torch.Tensor]

    @classmethod
    def take(
        cls, staging: StagingBuffer, num_tokens: int, num_rows: int, width: int, num_groups: int
    ) -> _StepBuffers:
        take = staging.take
        input_ids_np, input_ids = take(num_tokens, torch.int64)
        positions_np, positions = take(num_tokens, torch.int64)
        slots = [take(num_tokens, torch.int64) for _ in range(num_groups)]
        query_start_loc_np, query_start_loc = take(num_rows + 1, torch.int32)
        seq_lens_np, seq_lens = take(num_rows, torch.int32)
        tables = [take(num_rows * width, torch.int32) for _ in range(num_groups)]
        return cls(
            input_ids_np,
            input_ids,
            positions_np,
            positions,
            [slot_np for slot_np, _ in slots],
            tuple(slot for _, slot in slots),
            query_start_loc_np,
            query_start_loc,
            seq_lens_np,
            seq_lens,
            [table_np.reshape(num_rows, width) for table_np, _ in tables],
            [table for _, table in tables],
        )

    def pad(self, num_tokens: int, num_reqs: int, num_rows: int) -> None:
        """Padding tokens and requests of a CUDA-graph batch (see `InputBuffers.prepare`)."""
        for array in (self.input_ids_np, self.positions_np, *self.slot_nps):
            array[num_tokens:] = 0
        self.query_start_loc_np[num_reqs + 1 :] = np.arange(
            num_tokens + 1, num_tokens + 1 + num_rows - num_reqs
        )
        self.seq_lens_np[num_reqs:] = 1
        for table_np in self.tables_np:
            table_np[num_reqs:, 0] = 0


@dataclass(slots=True)
class _Rows:
    """What the host keeps of a step's rows: the attention bounds and the sampled tokens."""

    query_start_loc: list[int]
    seq_lens: list[int]
    logits_indices: list[int]
    sampled_req_ids: list[str]
    placeholder_indices: list[int]
    placeholder_rows: list[int]


def _fill_rows(
    step: _StepBuffers,
    requests: Mapping[str, RequestTokens],
    num_scheduled_tokens: Mapping[str, int],
    last_sampled_rows: Mapping[str, int],
    block_size: int,
    drafts: Mapping[str, list[int]],
) -> _Rows:
    """Writes each scheduled request's tokens, positions, slots and block table row."""
    input_ids_np, positions_np, slot_nps = step.input_ids_np, step.positions_np, step.slot_nps
    tables_np = step.tables_np
    # The common single-group case fills its one table and slot array without a loop.
    single_group = len(tables_np) == 1
    table_np0, slot_np0 = tables_np[0], slot_nps[0]
    num_reqs = len(num_scheduled_tokens)
    rows = _Rows([0] * (num_reqs + 1), [0] * num_reqs, [], [], [], [])
    query_start_loc, seq_lens = rows.query_start_loc, rows.seq_lens
    logits_indices, sampled_req_ids = rows.logits_indices, rows.sampled_req_ids
    placeholder_indices, placeholder_rows = rows.placeholder_indices, rows.placeholder_rows
    offset = 0
    for i, (req_id, n) in enumerate(num_scheduled_tokens.items()):
        state = requests[req_id]
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
        query_start_loc[i + 1] = offset
        seq_lens[i] = end
        if end == num_known + state.num_output_placeholders:
            if drafts and req_id in drafts:
                logits_indices.extend(range(offset - 1 - len(drafts[req_id]), offset))
            else:
                logits_indices.append(offset - 1)
            sampled_req_ids.append(req_id)
    step.query_start_loc_np[: num_reqs + 1] = rows.query_start_loc
    step.seq_lens_np[:num_reqs] = rows.seq_lens
    return rows
