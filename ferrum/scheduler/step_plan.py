"""The step `Scheduler.schedule` is building: its token budget left and what it holds so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum.request import Request
from ferrum.scheduler.output import CachedRequestData, NewRequestData


@dataclass(slots=True)
class StepPlan:
    """One step being scheduled: the tokens left in its budget and what it holds so far."""

    budget: int
    max_requests: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    # Each scheduled request's num_computed_tokens before this step.
    computed_before: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Speculative decoding: the drafts each request verifies (part of its num_scheduled).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def has_room(self) -> bool:
        return len(self.num_scheduled) < self.max_requests

    def add(self, req_id: str, num_new: int, num_computed: int) -> None:
        self.num_scheduled[req_id] = num_new
        self.computed_before[req_id] = num_computed
        self.budget -= num_new
