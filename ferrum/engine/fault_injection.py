"""Test-only fault hooks around the executor, driven by FERRUM_DEBUG_* knobs (`envs.py`):
a forward that raises once (`FERRUM_DEBUG_FAIL_FORWARD`, first core only), poison requests
that make every forward holding them raise (`FERRUM_DEBUG_FAIL_ON_TOKEN`, every core), and
forwards kept busy on the CPU first (`FERRUM_DEBUG_SLOW_FORWARD`, every core)."""

from __future__ import annotations

import time
from typing import Any

from ferrum import envs
from ferrum.executor import Executor
from ferrum.logger import init_logger
from ferrum.scheduler.output import SchedulerOutput

logger = init_logger(__name__)


def with_injected_faults(executor: Executor, core_index: int) -> Any:
    """`executor`, wrapped if a fault knob is set. `core_index`: 0 for the first core of a server
    (or an in-process engine), n for its nth restart."""
    fail_at = envs.debug_fail_forward() if core_index == 0 else None
    poison_token_id = envs.debug_fail_on_token()
    slow_seconds = envs.debug_slow_forward()
    if fail_at is None and poison_token_id is None and not slow_seconds:
        return executor
    return FaultInjectingExecutor(executor, fail_at, poison_token_id, slow_seconds)


class FaultInjectingExecutor:
    """The executor's `fail_at`th non-empty step launch raises, and so does every launch that
    schedules a request whose prompt holds `poison_token_id`; everything else is the wrapped
    executor's."""

    def __init__(
        self,
        executor: Executor,
        fail_at: int | None,
        poison_token_id: int | None,
        slow_seconds: float = 0.0,
    ) -> None:
        self.executor = executor
        self.slow_seconds = slow_seconds
        self.fail_at = fail_at
        self.poison_token_id = poison_token_id
        self.num_launches = 0
        # Requests whose prompt holds the poison token, from admission until they finish.
        self._poisoned: set[str] = set()
        if fail_at is not None:
            logger.warning("FERRUM_DEBUG_FAIL_FORWARD=%d: forward %d will raise", fail_at, fail_at)
        if poison_token_id is not None:
            logger.warning(
                "FERRUM_DEBUG_FAIL_ON_TOKEN=%d: forwards of prompts holding it will raise",
                poison_token_id,
            )
        if slow_seconds:
            logger.warning("FERRUM_DEBUG_SLOW_FORWARD=%g: each forward first spins", slow_seconds)

    def launch(
        self,
        scheduler_output: SchedulerOutput,
        matchers: dict[str, Any] | None = None,
        defer_sampling: bool = False,
    ) -> Any:
        self._poisoned -= scheduler_output.finished_req_ids
        for new in scheduler_output.scheduled_new_reqs:
            if self.poison_token_id in new.prompt_token_ids:
                self._poisoned.add(new.req_id)
        if not scheduler_output.is_empty:
            self.num_launches += 1
            if self.num_launches == self.fail_at:
                raise RuntimeError(
                    f"injected fault in forward {self.fail_at} (FERRUM_DEBUG_FAIL_FORWARD)"
                )
            poisoned = sorted(self._poisoned & scheduler_output.num_scheduled_tokens.keys())
            if poisoned:
                raise RuntimeError(
                    f"injected fault: token {self.poison_token_id} in the prompt of "
                    f"{poisoned} (FERRUM_DEBUG_FAIL_ON_TOKEN)"
                )
            deadline = time.monotonic() + self.slow_seconds
            while time.monotonic() < deadline:  # busy, as a slow step on the CPU is
                pass
        return self.executor.launch(scheduler_output, matchers, defer_sampling)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.executor, name)
