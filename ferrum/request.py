"""The request-level types every layer shares: the engine's view of one sequence being
generated, its status, the logprobs of one sampled position, and the length check a request must
pass before it is queued. Plain Python: no torch."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ferrum.errors import FieldError
from ferrum.sampling_params import ResolvedSamplingParams

if TYPE_CHECKING:
    from ferrum.lora_request import RequestLoRA
    from ferrum.structured_output.manager import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Every status after this one is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence: its tokens, how many are in the KV cache, and its status. Invariant:
    `num_computed_tokens <= num_tokens + num_output_placeholders`; tokens in
    `[num_computed_tokens, num_tokens)` still need a forward before the next sample. A placeholder
    is a token a launched step samples that the scheduler has not seen yet (async scheduling).
    """

    __slots__ = (
        "req_id",
        "prompt_token_ids",
        "output_token_ids",
        "all_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "first_scheduled_time",
        "status",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "block_hashes",
        "stop_reason",
        "grammar",
        "lora",
        "prompt_logprobs",
        "spec_token_ids",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling_params: ResolvedSamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # time.monotonic() when the scheduler first admitted it (None while waiting).
        self.first_scheduled_time: float | None = None
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (-1: not admitted yet).
        self.num_cached_tokens = -1
        # Tokens sampled by launched steps whose values have not been appended yet (0, 1 or 2).
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        # Chained hashes of the full blocks of `all_token_ids`, extended by the KV manager.
        self.block_hashes: list[int] = []
        # The stop token id or stop string that finished the request, if any.
        self.stop_reason: int | str | None = None
        # Structured outputs: the grammar (compiling, then its matcher); set by the engine core.
        self.grammar: RequestGrammar | None = None
        # LoRA: the request's adapter (its weights may still be loading); set by the engine core.
        self.lora: RequestLoRA | None = None
        # Speculative decoding: the proposer's drafts for the next step (verified there).
        self.spec_token_ids: list[int] = []
        # prompt_logprobs: positions 1, 2, ... of the prompt collected so far, until they are
        # sent with the first output token (then None; None too when not asked for).
        self.prompt_logprobs: list[Logprobs] | None = (
            [] if sampling_params.prompt_logprobs is not None else None
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def block_hash_extra_keys(self) -> tuple[int] | None:
        """What keys this request's prefix-cache blocks besides their tokens: its adapter, so
        requests of two adapters (or one and the base model) never share KV."""
        return None if self.lora is None else (self.lora.lora_int_id,)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


@dataclass(slots=True)
class Logprobs:
    """Log-probabilities of one sampled position: the sampled token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    # Rank of the sampled token in the full distribution (1 = most likely).
    sampled_rank: int


def check_request_fits(
    num_prompt_tokens: int, max_tokens: int, max_model_len: int, pool_tokens: int
) -> None:
    """Raises FieldError("prompt") if a request could never run, whatever else is in the
    engine."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise FieldError(
            "prompt",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
            f"exceeds max_model_len={max_model_len}",
        )
    if total > pool_tokens:
        raise FieldError(
            "prompt",
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} "
            f"exceeds the KV cache capacity of {pool_tokens} tokens (num_kv_blocks); "
            f"raise num_kv_blocks or lower max_tokens",
        )
