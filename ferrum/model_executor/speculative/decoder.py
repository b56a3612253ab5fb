"""The runner's side of speculative decoding: after a step's tokens are known, drafts for each
request's next step (the scheduler decides how many it verifies), from prompt lookup, a draft
model or the benchmark's replay. Constrained requests (structured outputs) get no drafts, and
no request does once `disable_by_batch_size` requests run. A draft model also follows every
target forward (its KV) and owns a cache beside the target's."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ferrum.config import EngineConfig
from ferrum.kv.kv_cache_spec import KVCacheGroupSpec
from ferrum.model_executor.cuda_graph import CUDAGraphRunner
from ferrum.model_executor.input_batch import InputBuffers, StepInputs
from ferrum.model_executor.runner_state import CachedRequestState
from ferrum.model_executor.speculative.draft_model import DraftModel
from ferrum.model_executor.speculative.ngram_proposer import NgramProposer
from ferrum.model_executor.speculative.replay_proposer import ReplayProposer


class SpeculativeDecoder:
    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
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
        if spec.method == "ngram":
            self.ngram = NgramProposer(k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec.method == "replay":
            assert spec.model is not None
            self.replay = ReplayProposer(k, spec.model, spec.acceptance_rate, vocab_size)
        else:
            assert spec.method == "draft_model" and config.draft_model_config is not None
            # The first group is full attention when the model has any (checked at config).
            assert kv_cache_groups[0].sliding_window is None and not kv_cache_groups[0].recurrent
            self.draft = DraftModel(config, config.draft_model_config, 0, kernel_backend, device)

    def draft_kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """What the draft model's cache adds to each block of the first layer group."""
        return 0 if self.draft is None else self.draft.kv_bytes_per_block(block_size, dtype)

    def bind_kv_cache(self, num_blocks: list[int], block_size: int, dtype: torch.dtype) -> None:
        if self.draft is not None:
            self.draft.bind_kv_cache(num_blocks[0], block_size, dtype)

    def release_kv_cache(self) -> None:
        if self.draft is not None:
            self.draft.release_kv_cache()

    def capture_graphs(self, target_graphs: CUDAGraphRunner) -> None:
        if self.draft is not None:
            self.draft.capture_graphs(target_graphs)

    def follow(self, inputs: StepInputs, shape: tuple[int, int] | None, num_tokens: int) -> None:
        """After the target's forward of a step: the draft model's forward of the same inputs."""
        if self.draft is not None:
            self.draft.follow(inputs, shape, num_tokens)

    def propose(
        self,
        states: Sequence[CachedRequestState],
        num_running: int,
        inputs: InputBuffers,
        block_size: int,
    ) -> dict[str, list[int]]:
        """Drafts per request id (requests without any are left out)."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return {}
        chosen, limits = [], []
        for state in states:
            params = state.params
            if params.structured_outputs is not None:
                continue
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
    vocab_size: int,
    kv_cache_groups: Sequence[KVCacheGroupSpec],
    kernel_backend: str,
    device: torch.device,
) -> SpeculativeDecoder | None:
    """The runner's decoder with a speculative_config, else None."""
    if config.speculative_config is None:
        return None
    return SpeculativeDecoder(config, vocab_size, kv_cache_groups, kernel_backend, device)


def max_sampled_rows(config: EngineConfig) -> int:
    """The most rows a step samples: a row per request, and one per draft of the requests that
    verify some (fewer than disable_by_batch_size: none get drafts once that many run)."""
    max_num_seqs = config.scheduler_config.max_num_seqs
    spec = config.speculative_config
    if spec is None:
        return max_num_seqs
    limit = spec.disable_by_batch_size
    num_verifying = max_num_seqs if limit is None else min(max_num_seqs, limit - 1)
    return max_num_seqs + num_verifying * spec.num_speculative_tokens


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
