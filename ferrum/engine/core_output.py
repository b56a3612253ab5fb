"""What the engine core sends back each step: plain data, no torch (the API process unpickles it)."""

from __future__ import annotations

from dataclasses import dataclass

from ferrum.scheduler.output import Logprobs


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's progress in one step."""

    req_id: str
    new_token_ids: list[int]
    # "stop" / "length" / "abort" once finished by the core, else None.
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: Logprobs | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
