"""The two messages between scheduler and model runner: the scheduler never touches tensors and the
runner never touches the block pool, so everything the runner needs for one step travels in a
`SchedulerOutput`, and everything the scheduler needs back in a `ModelRunnerOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.lora_request import LoRAStep
from ferrum.request import Logprobs
from ferrum.sampling_params import ResolvedSamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (first admission, or resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; they are recomputed like the prompt.
    output_token_ids: list[int]
    sampling_params: ResolvedSamplingParams
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
    # Speculative decoding: per request verifying drafts, the draft tokens that follow its next
    # token (they are the last of its num_scheduled_tokens).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # LoRA: the new requests' adapters and the runner's host-cache updates (None: nothing).
    lora: LoRAStep | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """Pickles the running requests' diffs as three columns: a step crosses a process
        boundary once per worker (tensor parallelism), and per-object pickling of a 256-request
        decode costs several times more."""
        cached = self.scheduled_cached_reqs
        return (
            _unpickle_scheduler_output,
            (
                self.scheduled_new_reqs,
                [c.req_id for c in cached],
                [c.new_block_ids for c in cached],
                [c.num_computed_tokens for c in cached],
                self.num_scheduled_tokens,
                self.total_num_scheduled_tokens,
                self.finished_req_ids,
                self.preempted_req_ids,
                self.step_id,
                self.scheduled_spec_decode_tokens,
                self.lora,
            ),
        )


def _unpickle_scheduler_output(
    new_reqs: list[NewRequestData],
    cached_req_ids: list[str],
    cached_new_block_ids: list[list[int]],
    cached_num_computed_tokens: list[int],
    num_scheduled_tokens: dict[str, int],
    total_num_scheduled_tokens: int,
    finished_req_ids: set[str],
    preempted_req_ids: set[str],
    step_id: int,
    scheduled_spec_decode_tokens: dict[str, list[int]],
    lora: LoRAStep | None,
) -> SchedulerOutput:
    cached = list(
        map(CachedRequestData, cached_req_ids, cached_new_block_ids, cached_num_computed_tokens)
    )
    return SchedulerOutput(
        new_reqs,
        cached,
        num_scheduled_tokens,
        total_num_scheduled_tokens,
        finished_req_ids,
        preempted_req_ids,
        step_id,
        scheduled_spec_decode_tokens,
        lora,
    )


@dataclass(slots=True)
class SpecDecodeOutput:
    """What speculative decoding adds to a step's output."""

    # Per request that verified drafts: the drafts it accepted, which precede its sampled token.
    accepted_token_ids: dict[str, list[int]]
    # Their logprobs, for the requests that asked for logprobs.
    accepted_logprobs: dict[str, list[Logprobs]]
    # The proposer's drafts for each request's next step.
    draft_token_ids: dict[str, list[int]]


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
    spec_decode: SpecDecodeOutput | None = None
