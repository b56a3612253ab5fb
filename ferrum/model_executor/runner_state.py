"""What a model runner keeps per request and per launched step (`model_runner.py`).

The runner keeps its own copy of each scheduled request's tokens and block tables: new requests
arrive once in full, running ones as diffs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ferrum.model_executor.prompt_logprobs import PromptLogprobsChunk
from ferrum.model_executor.sampler import SamplerOutput, advance_sampling_generator
from ferrum.request import Logprobs
from ferrum.sampling_params import ResolvedSamplingParams
from ferrum.scheduler.output import ModelRunnerOutput, SchedulerOutput, SpecDecodeOutput
from ferrum.structured_output import StructuredOutputMatcher

# The weight of a verify step's acceptance in a request's moving average.
ACCEPTANCE_WEIGHT = 0.3


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # prompt + output tokens; positions [num_computed_tokens, len) still need a forward.
    token_ids: list[int]
    params: ResolvedSamplingParams
    # One block table per KV cache group.
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    generator: torch.Generator | None
    # Sampled by launched steps and not yet completed (appended to token_ids on completion).
    num_output_placeholders: int = 0
    # Speculative decoding: a moving average of the fraction of its drafts accepted.
    draft_acceptance: float = 1.0


class RequestStates(dict[str, CachedRequestState]):
    """The scheduled requests' states by id, kept up to date by `apply`, and the generators of
    seeded requests: each lives from a request's first admission to its end, across
    preemptions."""

    def __init__(self, num_kv_groups: int, vocab_size: int, device: torch.device) -> None:
        super().__init__()
        self.num_kv_groups = num_kv_groups
        self.vocab_size = vocab_size
        self.device = device
        self.generators: dict[str, torch.Generator] = {}

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Forgets finished and preempted requests (a preempted one keeps its generator), adds
        the new ones and applies the running ones' diffs."""
        for req_id in scheduler_output.finished_req_ids:
            self.pop(req_id, None)
            self.generators.pop(req_id, None)
        for req_id in scheduler_output.preempted_req_ids:
            self.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            if len(new.block_ids) != self.num_kv_groups:
                raise ValueError(
                    f"block_ids of {new.req_id!r}: expected one table per KV cache group "
                    f"({self.num_kv_groups}), got {len(new.block_ids)}"
                )
            params = new.sampling_params
            self[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                token_ids=new.prompt_token_ids + new.output_token_ids,
                params=params,
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=self._generator_for(new.req_id, params, len(new.output_token_ids)),
            )
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self[cached.req_id]
            for block_ids, new_block_ids in zip(state.block_ids, cached.new_block_ids):
                block_ids.extend(new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _generator_for(
        self, req_id: str, params: ResolvedSamplingParams, num_output_tokens: int
    ) -> torch.Generator | None:
        """A seeded request's generator. One made for a request that already has output tokens
        (resumed by a new engine core) replays the draws that sampled them: its next token is
        the one the request would have drawn without the restart."""
        if params.seed is None or params.temperature == 0.0:
            return None
        generator = self.generators.get(req_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
            advance_sampling_generator(generator, num_output_tokens, self.vocab_size, self.device)
            self.generators[req_id] = generator
        return generator


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device: its sampled requests, in batch order, and the host copy of
    its sampler output, valid once `done` (None on the CPU) has completed."""

    req_ids: list[str]
    states: list[CachedRequestState]
    output: SamplerOutput | None
    done: torch.cuda.Event | None
    # prompt_logprobs of the requests whose prompt positions ran in this step.
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    # The forward's logits while the step awaits `ModelRunner.sample`.
    pending: PendingSample | None = None
    # Pipeline parallelism: the buffer the last stage's sampled tokens are broadcast into, and
    # the broadcast's handle (wait before reading).
    token_broadcast: tuple[torch.Tensor, Any] | None = None
    # Speculative decoding: each sampled request's drafts (in `req_ids` order), when any has,
    # and the generator states of its seeded requests with drafts before they drew (by index).
    drafts: list[list[int]] | None = None
    generator_states: dict[int, torch.Tensor] = field(default_factory=dict)
    # An EAGLE-3 head's (normed, pre-norm) outputs at the step's sampled rows.
    head_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def awaits_sampling(self) -> bool:
        return self.pending is not None


@dataclass(slots=True)
class PendingSample:
    logits: torch.Tensor  # [num sampled rows, vocab]
    # The grammars of the step's constrained requests (None when no sampled row has one).
    matchers: dict[str, StructuredOutputMatcher] | None


def append_sampled(
    step: LaunchedStep,
    sampled: list[int],
    logprobs: list | None,
    prompt_logprobs: dict | None,
) -> ModelRunnerOutput:
    """Appends a completed step's tokens to its requests' states; the step's runner output."""
    for state, token_id in zip(step.states, sampled):
        state.num_output_placeholders -= 1
        state.output_token_ids.append(token_id)
        state.token_ids.append(token_id)
    if logprobs is not None and all(lp is None for lp in logprobs):
        logprobs = None
    return ModelRunnerOutput(step.req_ids, sampled, logprobs, prompt_logprobs)


def append_verified(
    step: LaunchedStep,
    tokens: list[list[int]],
    token_logprobs: list[list[Logprobs | None]] | None,
    prompt_logprobs: dict | None,
) -> ModelRunnerOutput:
    """`append_sampled` for a step that verified drafts: each request emits `tokens[i]` (its
    accepted drafts, then its sampled token) and forgets the KV of its rejected drafts."""
    assert step.drafts is not None
    accepted: dict[str, list[int]] = {}
    accepted_logprobs: dict[str, list[Logprobs]] = {}
    sampled, logprobs = [], []
    for i, (state, emitted, drafts) in enumerate(zip(step.states, tokens, step.drafts)):
        state.num_output_placeholders -= 1
        state.output_token_ids.extend(emitted)
        state.token_ids.extend(emitted)
        state.num_computed_tokens -= len(drafts) + 1 - len(emitted)
        if drafts:
            rate = (len(emitted) - 1) / len(drafts)
            state.draft_acceptance += ACCEPTANCE_WEIGHT * (rate - state.draft_acceptance)
        sampled.append(emitted[-1])
        entries = None if token_logprobs is None else token_logprobs[i]
        logprobs.append(None if entries is None else entries[-1])
        if drafts:
            accepted[state.req_id] = emitted[:-1]
            if entries is not None and entries[0] is not None:
                accepted_logprobs[state.req_id] = entries[:-1]  # type: ignore[assignment]
    spec = SpecDecodeOutput(accepted, accepted_logprobs, {})
    if all(lp is None for lp in logprobs):
        return ModelRunnerOutput(step.req_ids, sampled, None, prompt_logprobs, spec)
    return ModelRunnerOutput(step.req_ids, sampled, logprobs, prompt_logprobs, spec)


def with_drafts(
    spec: SpecDecodeOutput | None, drafts: dict[str, list[int]]
) -> SpecDecodeOutput | None:
    """A step's speculative output with the proposer's drafts for the next step (None when the
    step verified none and none are proposed)."""
    if spec is None:
        return SpecDecodeOutput({}, {}, drafts) if drafts else None
    spec.draft_token_ids = drafts
    return spec
