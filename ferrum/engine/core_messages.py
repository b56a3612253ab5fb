"""Every message between the front end and the engine core (`ToCore`, `FromCore`): plain data,
no torch (the API process unpickles them), one slotted dataclass each; receivers match on type.
The core sends `CoreInfo` once loaded, `CoreOutputs` after every step and after control messages
that changed state, and `CoreFailed` just before it exits on an error."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.lora_request import LoRARequest
from ferrum.request import Logprobs, RequestStatus
from ferrum.sampling_params import ResolvedSamplingParams


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """One completion to generate, validated and resolved once by the front end
    (`InputProcessor`); the core builds its `Request` from it and checks nothing again."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: ResolvedSamplingParams
    # The primary EOS id (it stops with stop_reason None); None with ignore_eos.
    eos_token_id: int | None
    arrival_time: float
    # Tokens a previous core already generated (a request resumed after a core restart): the
    # core counts them as outputs, as for a preempted request.
    output_token_ids: list[int] = field(default_factory=list)
    # The completion's own max_tokens when sampling_params' is a probation run's one-token limit:
    # its grammar closes within the completion's budget, not the trial's.
    grammar_max_tokens: int | None = None
    # The LoRA adapter the completion runs with (None: the base model).
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's progress in one step."""

    req_id: str
    new_token_ids: list[int]
    # "stop" / "length" / "abort" once finished by the core, else None.
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # One entry per new token, when the request asked for logprobs.
    logprobs: list[Logprobs] | None = None
    # prompt_logprobs, once, with the first output token: prompt positions 1, 2, ... (the
    # prompt token first in each).
    prompt_logprobs: list[Logprobs] | None = None
    num_cached_tokens: int = 0
    # time.monotonic() in the core when the request was first scheduled (its queue time ends).
    first_scheduled_time: float | None = None


# Upper bounds of the buckets of tokens per engine step (vLLM's iteration_tokens_total).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Since start: non-empty steps per ITERATION_TOKENS_BUCKETS bucket of their token count (one
    # more entry for larger steps), and the tokens of all of them.
    iteration_tokens_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0
    # Speculative decoding since start: drafts verified (one per request and step), their
    # tokens, the accepted ones, and the accepted ones by draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # LoRA: the adapters of the running and of the waiting requests, by name (sorted).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()


@dataclass(slots=True)
class FinishRequests:
    """Aborted (their blocks return to the pool at once) or stopped by a stop string."""

    req_ids: list[str]
    status: RequestStatus


@dataclass(slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """The core is loaded: what the front end needs from it."""

    num_kv_blocks: int
    max_tokens_in_pool: int
    # Seconds spent in the core process before it was ready: imports, then EngineCore(...).
    import_seconds: float
    engine_seconds: float
    # The core's tensor-parallel worker processes (rank order); empty when the model runs in
    # the core process.
    worker_pids: tuple[int, ...] = ()


@dataclass(slots=True)
class CoreOutputs:
    outputs: list[EngineCoreOutput]
    # None from a core in the front end's thread (its stats are read when asked for).
    stats: SchedulerStats | None


@dataclass(slots=True)
class CoreFailed:
    reason: str
    # The requests of the failed step when a step raised; None when the cause is unknown (the
    # process died, or failed outside a step).
    req_ids: list[str] | None = None


ToCore = EngineCoreRequest | FinishRequests | Shutdown
FromCore = CoreInfo | CoreOutputs | CoreFailed
