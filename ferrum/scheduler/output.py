"""The two messages between scheduler and model runner.

The scheduler never touches tensors and the runner never touches the block pool: everything the
runner needs for one step travels in a `SchedulerOutput`, and everything the scheduler needs back
travels in a `ModelRunnerOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.request import Logprobs
from ferrum.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (first admission, or resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; they are recomputed like the prompt.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # One block table per KV cache layer group.
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed since the previous step."""

    req_id: str
    # Block ids appended to each KV cache layer group's table.
    new_block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # Tokens to run this step per request; their sum is at most max_num_batched_tokens.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that finished (or were aborted) since the previous step: the runner forgets them.
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted this step: the runner drops their batch state but keeps their sampling
    # generator, so a resumed seeded request continues the same random stream.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Numbers the scheduler's steps; the scheduler matches outputs to the requests it scheduled.
    step_id: int = 0

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    # Requests that produced a token this step, in batch order (partial prefills produce none).
    req_ids: list[str]
    sampled_token_ids: list[int]
    # One entry per sampled request when any request in the batch asked for logprobs.
    logprobs: list[Logprobs | None] | None = None
    # prompt_logprobs: per request computing prompt positions this step, the first position it
    # covers (>= 1: position 0 has none) and one entry per position, the prompt token first.
    prompt_logprobs: dict[str, tuple[int, list[Logprobs]]] | None = None


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
