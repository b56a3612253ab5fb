"""What a model runner keeps per request and per launched step (`model_runner.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ferrum.model_executor.prompt_logprobs import PromptLogprobsChunk
from ferrum.model_executor.sampler import SamplerOutput
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.output import ModelRunnerOutput
from ferrum.structured_output import StructuredOutputMatcher


@dataclass(slots=True)
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # prompt + output tokens; positions [num_computed_tokens, len) still need a forward.
    token_ids: list[int]
    params: SamplingParams
    # One block table per KV cache group.
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    generator: torch.Generator | None
    # Sampled by launched steps and not yet completed (appended to token_ids on completion).
    num_output_placeholders: int = 0


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
