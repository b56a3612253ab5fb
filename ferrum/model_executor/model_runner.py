"""Turns a SchedulerOutput into one model forward plus sampling.

The runner keeps its own copy of each scheduled request's tokens and block table (new requests
arrive once in full, running ones as diffs) and never touches the block pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferrum.config import EngineConfig
from ferrum.model_executor.attention_metadata import AttentionMetadata
from ferrum.model_executor.kernel_backend import apply_kernel_backend
from ferrum.model_executor.kv_cache_sizing import (
    allocate_kv_caches,
    cpu_kv_budget,
    kv_bytes_per_block,
    num_blocks_from_budget,
)
from ferrum.model_executor.model_loader import load_model
from ferrum.model_executor.sampler import Sampler, SamplerOutput
from ferrum.model_executor.sampling_metadata import SamplingMetadata, SamplingRow
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.output import Logprobs, ModelRunnerOutput, SchedulerOutput

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # prompt + output tokens; positions [num_computed_tokens, len) still need a forward.
    token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None


@dataclass(slots=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    # Flat indices of the tokens whose logits are sampled, and the requests they belong to.
    logits_indices: torch.Tensor
    sampled_req_ids: list[str]


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        self.dtype = torch_dtype(config.model_config.dtype)
        self.block_size = config.cache_config.block_size
        self.vocab_size = config.model_config.vocab_size
        self.model = load_model(config.model_config, device)
        self.kernel_backend = apply_kernel_backend(
            self.model, config.device_config.kernel_backend, device
        )
        self.split_kv_workspace = self._allocate_split_kv_workspace()
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.model_config.seed)
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, CachedRequestState] = {}
        # Seeded generators live from a request's first admission to its end, across preemptions.
        self._seeded_generators: dict[str, torch.Generator] = {}

    def _allocate_split_kv_workspace(self) -> Any:
        """Scratch for the split-KV decode kernel on CUDA, sized once for the whole run."""
        if self.kernel_backend != "triton" or self.device.type != "cuda":
            return None
        from ferrum.kernels.paged_attention import allocate_split_kv_workspace

        model_config = self.config.model_config
        return allocate_split_kv_workspace(
            self.config.scheduler_config.max_num_seqs,
            model_config.num_attention_heads,
            model_config.head_dim,
            model_config.max_model_len,
            self.device,
        )

    def determine_num_kv_blocks(self) -> int:
        """KV blocks for the pool: the CPU budget, or what a profiled peak leaves on the GPU."""
        cfg = self.config
        if self.device.type != "cuda":
            budget = cpu_kv_budget(cfg.cache_config)
        elif cfg.cache_config.kv_cache_memory_bytes is not None:
            budget = cfg.cache_config.kv_cache_memory_bytes
        else:
            budget = self._profile_gpu_kv_budget()
        return num_blocks_from_budget(
            budget, cfg.model_config, cfg.cache_config, cfg.scheduler_config, self.dtype
        )

    @torch.inference_mode()
    def _profile_gpu_kv_budget(self) -> int:
        """Runs one forward + sampling at max_num_batched_tokens and measures the peak."""
        sched = self.config.scheduler_config
        free_before, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free_before) - torch.cuda.memory_reserved(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = sched.max_num_batched_tokens
        seq_lens = []
        while sum(seq_lens) < num_tokens:
            seq_lens.append(min(sched.max_model_len, num_tokens - sum(seq_lens)))
        num_blocks = sum(-(-n // self.block_size) for n in seq_lens) + 1
        self.initialize_kv_cache(num_blocks)
        temp_kv_bytes = num_blocks * kv_bytes_per_block(
            self.config.model_config, self.block_size, self.dtype
        )
        batch = _profile_batch(seq_lens, self.block_size, self.device)
        hidden = self.model(batch.input_ids, batch.positions, batch.attn_metadata)
        num_sampled = min(sched.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:num_sampled])
        rows = [
            SamplingRow(SamplingParams(temperature=1.0, top_p=0.9, top_k=50), [], [], None, set())
        ] * num_sampled
        self.sampler(logits, SamplingMetadata.from_rows(rows, self.vocab_size, self.device))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - temp_kv_bytes
        self.kv_caches = []
        self.model.bind_kv_caches([])
        del hidden, logits
        torch.cuda.empty_cache()
        util = self.config.cache_config.gpu_memory_utilization
        budget = int(total * util) - peak - non_torch
        if budget <= 0:
            raise ValueError(
                f"the model and a forward of max_num_batched_tokens={num_tokens} peak at "
                f"{peak / 2**30:.2f} GiB, leaving no KV cache room under gpu_memory_utilization="
                f"{util} of {total / 2**30:.1f} GiB: raise gpu_memory_utilization or lower "
                f"max_num_batched_tokens"
            )
        return budget

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(
            self.config.model_config, num_blocks, self.block_size, self.dtype, self.device
        )
        self.model.bind_kv_caches(self.kv_caches)

    # -- request state ---------------------------------------------------------------------------

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self._seeded_generators.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                token_ids=new.prompt_token_ids + new.output_token_ids,
                params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=self._generator_for(new.req_id, new.sampling_params),
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _generator_for(self, req_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.temperature == 0.0:
            return None
        generator = self._seeded_generators.get(req_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
            self._seeded_generators[req_id] = generator
        return generator

    # -- one step --------------------------------------------------------------------------------

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> BatchInputs:
        block_size = self.block_size
        req_ids = list(scheduler_output.num_scheduled_tokens)
        num_reqs = len(req_ids)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slot_mapping = np.empty(num_tokens, dtype=np.int64)
        query_start_loc = [0] * (num_reqs + 1)
        seq_lens = [0] * num_reqs
        max_blocks = max(len(self.requests[r].block_ids) for r in req_ids)
        block_tables = np.zeros((num_reqs, max_blocks), dtype=np.int32)
        logits_indices: list[int] = []
        sampled_req_ids: list[str] = []
        offset = 0
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            n = scheduler_output.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + n
            input_ids[offset : offset + n] = state.token_ids[start:end]
            pos = np.arange(start, end, dtype=np.int64)
            positions[offset : offset + n] = pos
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            block_tables[i, : len(blocks)] = blocks
            slot_mapping[offset : offset + n] = blocks[pos // block_size] * block_size + (
                pos % block_size
            )
            offset += n
            query_start_loc[i + 1] = offset
            seq_lens[i] = end
            if end == len(state.token_ids):
                logits_indices.append(offset - 1)
                sampled_req_ids.append(req_id)

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        metadata = AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=num_tokens,
            max_query_len=max(scheduler_output.num_scheduled_tokens.values()),
            max_seq_len=max(seq_lens),
            query_start_loc=to_device(np.asarray(query_start_loc, dtype=np.int32)),
            seq_lens=to_device(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=to_device(block_tables),
            slot_mapping=to_device(slot_mapping),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            split_kv_workspace=self.split_kv_workspace,
        )
        return BatchInputs(
            input_ids=to_device(input_ids),
            positions=to_device(positions),
            attn_metadata=metadata,
            logits_indices=to_device(np.asarray(logits_indices, dtype=np.int64)),
            sampled_req_ids=sampled_req_ids,
        )

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        batch = self._prepare_inputs(scheduler_output)
        hidden_states = self.model(batch.input_ids, batch.positions, batch.attn_metadata)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += n
        if not batch.sampled_req_ids:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

        logits = self.model.compute_logits(hidden_states[batch.logits_indices])
        states = [self.requests[r] for r in batch.sampled_req_ids]
        rows = [
            SamplingRow(
                params=s.params,
                prompt_token_ids=s.prompt_token_ids,
                output_token_ids=s.output_token_ids,
                generator=s.generator,
                stop_token_ids=s.params.all_stop_token_ids,
            )
            for s in states
        ]
        metadata = SamplingMetadata.from_rows(rows, self.vocab_size, self.device)
        sampler_output = self.sampler(logits, metadata, self.generator)
        sampled = sampler_output.sampled_token_ids.tolist()
        for state, token_id in zip(states, sampled):
            state.output_token_ids.append(token_id)
            state.token_ids.append(token_id)
        return ModelRunnerOutput(
            req_ids=batch.sampled_req_ids,
            sampled_token_ids=sampled,
            logprobs=_logprobs_lists(states, sampler_output),
        )


def _logprobs_lists(
    states: list[CachedRequestState], output: SamplerOutput
) -> list[Logprobs | None] | None:
    if output.logprobs is None or all(s.params.logprobs is None for s in states):
        return None
    token_ids = output.logprob_token_ids.tolist()
    logprobs = output.logprobs.tolist()
    ranks = output.sampled_ranks.tolist()
    result: list[Logprobs | None] = []
    for i, state in enumerate(states):
        k = state.params.logprobs
        if k is None:
            result.append(None)
            continue
        result.append(Logprobs(token_ids[i][: k + 1], logprobs[i][: k + 1], ranks[i]))
    return result


def _profile_batch(seq_lens: list[int], block_size: int, device: torch.device) -> BatchInputs:
    """Prompts of the given lengths on consecutive blocks (from block 1), all tokens id 0."""
    num_tokens = sum(seq_lens)
    query_start_loc = [0]
    for n in seq_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slot_mapping = []
    positions = []
    next_block = 1
    for i, n in enumerate(seq_lens):
        num_blocks = -(-n // block_size)
        block_tables[i, :num_blocks] = torch.arange(next_block, next_block + num_blocks)
        slot_mapping.extend(range(next_block * block_size, next_block * block_size + n))
        positions.extend(range(n))
        next_block += num_blocks
    metadata = AttentionMetadata(
        num_reqs=len(seq_lens),
        num_tokens=num_tokens,
        max_query_len=max(seq_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=list(seq_lens),
    )
    return BatchInputs(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        attn_metadata=metadata,
        logits_indices=torch.empty(0, dtype=torch.int64, device=device),
        sampled_req_ids=[],
    )
