"""What the front end decides when its engine core crashes: whether to restart (the crash-loop
limit), which requests to blame, which must run alone. A crash in a known step gives its requests
a strike: two strikes fail a request; one puts it on probation, alone in the core until one more
token, so that a repeat crash blames it alone. A crash with no known step blames nobody.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ferrum.engine.core_messages import EngineCoreOutput, EngineCoreRequest
from ferrum.recovery_config import EngineRecoveryConfig

# Strikes after which a request is failed.
MAX_STRIKES = 2


@dataclass(slots=True)
class CrashVerdict:
    # Why the front end must give up (the crash-loop limit), or None: restart the core.
    give_up: str | None
    # Completions (child ids) failed for crashing the core twice.
    failed: list[str] = field(default_factory=list)


class RecoveryTracker:
    """Crash times, strikes and the probation queue of one front end. Child ids only; the
    caller forgets a completion (`forget`) once it is finished or aborted."""

    def __init__(
        self, config: EngineRecoveryConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self._crash_times: deque[float] = deque()
        self._strikes: dict[str, int] = {}
        # Completions with a strike that must run alone before rejoining the batch, in order.
        self._probation: deque[str] = deque()
        # The completion running alone in the core now.
        self.on_trial: str | None = None

    def record_crash(self, suspects: Iterable[str] | None) -> CrashVerdict:
        """Counts one crash. `suspects`: the open completions of the failing step, in arrival
        order, or None when the cause is unknown."""
        now = self._clock()
        self._crash_times.append(now)
        while self._crash_times[0] < now - self.config.engine_restart_window:
            self._crash_times.popleft()
        suspects = [] if suspects is None else list(suspects)
        trial, self.on_trial = self.on_trial, None
        if trial is not None and trial not in suspects:
            self._probation.appendleft(trial)  # its trial was cut short: it runs again
        failed = []
        for child_id in suspects:
            strikes = self._strikes[child_id] = self._strikes.get(child_id, 0) + 1
            if strikes >= MAX_STRIKES:
                failed.append(child_id)
                self.forget(child_id)
            elif child_id not in self._probation:
                self._probation.append(child_id)
        give_up = None
        if len(self._crash_times) > self.config.engine_max_restarts:
            give_up = (
                f"{len(self._crash_times)} engine-core crashes within "
                f"{self.config.engine_restart_window:g} s "
                f"(engine_max_restarts={self.config.engine_max_restarts})"
            )
        return CrashVerdict(give_up, failed)

    def start_next_trial(self) -> str | None:
        """The next completion on probation, now on trial; None when nobody is on probation."""
        assert self.on_trial is None
        if self._probation:
            self.on_trial = self._probation.popleft()
        return self.on_trial

    def pass_trial(self) -> str:
        """The completion on trial got a token alone: it is cleared of its strike."""
        child_id = self.on_trial
        assert child_id is not None
        self.on_trial = None
        self._strikes.pop(child_id, None)
        return child_id

    def forget(self, child_id: str) -> None:
        self._strikes.pop(child_id, None)
        if child_id in self._probation:
            self._probation.remove(child_id)
        if self.on_trial == child_id:
            self.on_trial = None

    @property
    def num_recent_crashes(self) -> int:
        """Crashes within the restart window, as of the latest one."""
        return len(self._crash_times)

    @property
    def num_on_probation(self) -> int:
        return len(self._probation) + (self.on_trial is not None)


def resumed_request(request: EngineCoreRequest, token_ids: list[int]) -> EngineCoreRequest:
    """`request` (as first validated) continuing after the output tokens it already has: the
    same prompt, params and id; the core counts `token_ids` as its outputs."""
    return dataclasses.replace(request, output_token_ids=token_ids) if token_ids else request


def trial_request(request: EngineCoreRequest) -> EngineCoreRequest:
    """A probation run: one more token, then the core finishes the request itself, so that no
    later output of this run can reach the completion once it rejoins the others."""
    max_tokens = len(request.output_token_ids) + 1
    params = dataclasses.replace(request.sampling_params, max_tokens=max_tokens)
    budget = request.sampling_params.max_tokens
    return dataclasses.replace(request, sampling_params=params, grammar_max_tokens=budget)


def unclip_trial_output(
    output: EngineCoreOutput, request: EngineCoreRequest, num_output_tokens: int, max_model_len: int
) -> EngineCoreOutput:
    """A trial's output without the "length" finish of its one-token run, unless the completion
    (`request` as first validated, `num_output_tokens` before this output) really is at its
    length limit."""
    if output.finish_reason != "length":
        return output
    num_output = num_output_tokens + len(output.new_token_ids)
    max_tokens = request.sampling_params.max_tokens
    if num_output >= max_tokens or len(request.prompt_token_ids) + num_output >= max_model_len:
        return output
    return dataclasses.replace(output, finish_reason=None, stop_reason=None)
