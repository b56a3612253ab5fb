"""The runner's side of speculative decoding: after a step's tokens are known, drafts for each
request's next step (the scheduler decides how many it verifies), from prompt lookup, a draft
model, an EAGLE-3 head, Qwen3.5's MTP layer or the benchmark's replay. Constrained requests
(structured outputs) get drafts too: each verify row's mask follows the drafts before it
(`grammar_bitmask.py`). No request gets drafts once `disable_by_batch_size` requests run. A
draft model or a head also follows every target forward (its KV) and owns a cache beside the
target's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ferrum.config import EngineConfig
from ferrum.kv.kv_cache_spec import KVCacheGroupSpec
from ferrum.model_executor.cuda_graph import CUDAGraphRunner
from ferrum.model_executor.input_batch import InputBuffers, RequestTokens, StepInputs
from ferrum.model_executor.runner_state import CachedRequestState, LaunchedStep
from ferrum.model_executor.speculative.draft_model import DraftModel
from ferrum.model_executor.speculative.eagle3 import Eagle3Proposer, HeadRows, sampled_rows
from ferrum.model_executor.speculative.mtp import MTPProposer
from ferrum.model_executor.speculative.ngram_proposer import NgramProposer
from ferrum.model_executor.speculative.proposer_model import ProposerModel
from ferrum.model_executor.speculative.replay_proposer import ReplayProposer
from ferrum.scheduler.output import ModelRunnerOutput


class SpeculativeDecoder:
    def __init__(
        self,
        config: EngineConfig,
        target: nn.Module,
        inputs: InputBuffers,
        kv_cache_groups: Sequence[KVCacheGroupSpec],
        kernel_backend: str,
        device: torch.device,
    ) -> None:
        spec = config.speculative_config
        assert spec is not None
        self.config = spec
        self.max_model_len = config.model_config.max_model_len
        k = spec.num_speculative_tokens
        self.ngram = self.replay = self.draft = None
        # A head over the target's hidden states: an EAGLE-3 head or the MTP layer.
        self.eagle3: Eagle3Proposer | None = None
        if spec.method == "ngram":
            self.ngram = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec.method == "replay":
            assert spec.model is not None
            vocab_size = config.model_config.vocab_size
            self.replay = ReplayProposer(k, spec.model, spec.acceptance_rate, vocab_size)
        else:
            # The first group is full attention when the model has any (checked at config).
            assert kv_cache_groups[0].sliding_window is None and not kv_cache_groups[0].recurrent
        if spec.method == "draft_model":
            assert config.draft_model_config is not None
            self.draft = DraftModel(config, config.draft_model_config, 0, kernel_backend, device)
        elif spec.method == "eagle3":
            assert config.eagle3_config is not None
            self.eagle3 = Eagle3Proposer(
                config, config.eagle3_config, target, inputs.max_num_tokens, kernel_backend, device
            )
        elif spec.method == "mtp":
            self.eagle3 = MTPProposer(config, target, inputs.max_num_tokens, kernel_backend, device)
        # The proposer that keeps a KV cache beside the target's, if any.
        self.model: ProposerModel | None = self.draft or self.eagle3

    def draft_kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """What the proposer's cache adds to each block of the first layer group."""
        return 0 if self.model is None else self.model.kv_bytes_per_block(block_size, dtype)

    def bind_kv_cache(self, num_blocks: list[int], block_size: int, dtype: torch.dtype) -> None:
        if self.model is not None:
            self.model.bind_kv_cache(num_blocks[0], block_size, dtype)

    def release_kv_cache(self) -> None:
        if self.model is not None:
            self.model.release_kv_cache()

    def capture_graphs(self, target_graphs: CUDAGraphRunner) -> None:
        if self.draft is not None:
            self.draft.capture_graphs(target_graphs)
        if self.eagle3 is not None:
            self.eagle3.capture_graphs(target_graphs)

    def follow(
        self,
        inputs: StepInputs,
        shape: tuple[int, int] | None,
        num_tokens: int,
        requests: Mapping[str, RequestTokens],
        num_scheduled: Mapping[str, int],
        hidden_states: torch.Tensor | None,
    ) -> None:
        """After the target's forward of a step (`hidden_states`: its output): the draft
        model's forward of the same inputs, or the head's pass once the step's tokens are
        sampled (`after_sampling`)."""
        if self.draft is not None:
            self.draft.follow(inputs, shape, num_tokens)
        if self.eagle3 is not None:
            self.eagle3.follow(inputs, shape, num_tokens, requests, num_scheduled, hidden_states)

    def after_sampling(self, sampled: torch.Tensor) -> HeadRows | None:
        """After a step's sampling is queued: an EAGLE-3 or MTP head's pass over the step."""
        return None if self.eagle3 is None else self.eagle3.after_sampling(sampled)

    def propose(
        self,
        states: Sequence[CachedRequestState],
        num_running: int,
        inputs: InputBuffers,
        block_size: int,
        step: LaunchedStep,
        output: ModelRunnerOutput,
    ) -> dict[str, list[int]]:
        """Drafts per request id (requests without any are left out) after `step` completed
        with `output`."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return {}
        chosen, limits = [], []
        for state in states:
            params = state.params
            k = self.config.num_speculative_tokens
            max_drafts = min(
                # The benchmark's replay always proposes k: its rate is set, not learned.
                k if self.replay is not None else drafts_worth_proposing(state, k),
                params.max_tokens - len(state.output_token_ids) - 1,
                self.max_model_len - len(state.token_ids) - 1,
            )
            if max_drafts > 0:
                chosen.append(state)
                limits.append(max_drafts)
        if self.draft is not None:
            return self.draft.propose(inputs, chosen, limits, block_size)
        if self.eagle3 is not None:
            if step.head_rows is None:
                return {}
            accepted = {} if output.spec_decode is None else output.spec_decode.accepted_token_ids
            rows = sampled_rows(step.req_ids, step.drafts, accepted)
            return self.eagle3.propose(inputs, chosen, limits, block_size, step.head_rows, rows)
        proposals = {}
        for state, max_drafts in zip(chosen, limits):
            if self.ngram is not None:
                drafts = self.ngram.propose(state.token_ids, max_drafts)
            else:
                assert self.replay is not None
                drafts = self.replay.propose(
                    state.prompt_token_ids, state.output_token_ids, max_drafts
                )
            if drafts:
                proposals[state.req_id] = drafts
        return proposals


def drafts_worth_proposing(state: CachedRequestState, k: int) -> int:
    """k while most of a request's recent drafts were accepted, 1 while few were, none while
    almost none were; the average creeps back up while the request proposes none, so that it
    tries again after ~20 steps (a text that turns repetitive)."""
    if state.draft_acceptance >= 0.4:
        return k
    if state.draft_acceptance >= 0.1:
        return 1
    state.draft_acceptance += 0.005
    return 0


def speculative_decoder(
    config: EngineConfig,
    target: nn.Module,
    inputs: InputBuffers,
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    kernel_backend: str,
    device: torch.device,
) -> SpeculativeDecoder | None:
    """The runner's decoder with a speculative_config, else None. `target`: the runner's
    model (an EAGLE-3 head reads its hidden states); `inputs`: the runner's input buffers."""
    if config.speculative_config is None:
        return None
    return SpeculativeDecoder(config, target, inputs, kv_cache_groups, kernel_backend, device)


def verify_graph_sizes(config: EngineConfig) -> dict[str, int]:
    """The verify CUDA graphs' query length and largest batch: the batches that speculate
    (fewer than disable_by_batch_size requests); none without speculative decoding."""
    spec = config.speculative_config
    if spec is None:
        return {}
    query_len = 1 + spec.num_speculative_tokens
    sched = config.scheduler_config
    largest = min(sched.max_num_seqs, 512, sched.max_num_batched_tokens // query_len)
    if spec.disable_by_batch_size is not None:
        largest = min(largest, spec.disable_by_batch_size - 1)
    return {"verify_query_len": query_len, "max_verify_batch_size": largest}


def max_verify_graph_tokens(config: EngineConfig) -> int:
    """Tokens of the largest verify CUDA graph (0 without speculative decoding)."""
    sizes = verify_graph_sizes(config)
    return sizes["verify_query_len"] * max(sizes["max_verify_batch_size"], 0) if sizes else 0
