"""The executor the engine core drives instead of a model runner, which lives in this process
(`UniProcExecutor`), in one worker process per tensor-parallel rank (`MultiprocExecutor`) or in one
Ray actor per rank (`RayExecutor`). Contract: set-up calls in order (`determine_num_kv_blocks`
unless the pool size is given, `initialize_kv_cache`, `warm_up`, `capture_cuda_graphs`); `launch`
queues a step and `complete` waits for the oldest, in launch order, at most one in flight while the
next launches; `sample` samples a `defer_sampling` step once the matchers are up to date."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ferrum.scheduler.output import ModelRunnerOutput, SchedulerOutput
from ferrum.structured_output import StructuredOutputMatcher


class WorkerDiedError(RuntimeError):
    """A worker process exited (killed, crashed outside Python): the cause of the failure is
    unknown, so no request of the step is to blame."""


class WorkerStepError(RuntimeError):
    """A worker's step raised: the step's requests are suspects, as for an in-process runner."""


class Executor(ABC):
    # "torch" or "triton": the kernels the runner(s) resolved to.
    kernel_backend: str

    @abstractmethod
    def determine_num_kv_blocks(self) -> list[int]:
        """KV blocks per layer group every rank can hold: the smallest of the ranks' sizings."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int | list[int]) -> None: ...

    @abstractmethod
    def warm_up(self, num_blocks: int | list[int]) -> None: ...

    @abstractmethod
    def capture_cuda_graphs(self) -> None: ...

    @abstractmethod
    def launch(
        self,
        scheduler_output: SchedulerOutput,
        matchers: dict[str, StructuredOutputMatcher] | None = None,
        defer_sampling: bool = False,
    ) -> Any:
        """Queues one step (`matchers`: the grammars of its constrained requests); returns the
        handle `sample` and `complete` take. Without `defer_sampling` (or when the handle does
        not `awaits_sampling`) the matchers must have accepted all of their requests' output
        tokens already."""

    @abstractmethod
    def sample(self, launched: Any) -> None:
        """Queues the sampling of a step that `awaits_sampling`, its grammar bitmask filled from
        the matchers now."""

    @abstractmethod
    def complete(self, launched: Any) -> ModelRunnerOutput:
        """Waits for the oldest launched step; raises WorkerDiedError / WorkerStepError (or the
        runner's own exception in process) if it failed."""

    @abstractmethod
    def check_health(self) -> None:
        """Raises WorkerDiedError or WorkerStepError if a worker has failed; never blocks."""

    @property
    @abstractmethod
    def failure_sentinels(self) -> list[Any]:
        """Objects for `multiprocessing.connection.wait` that become ready when a worker fails
        (then `check_health` raises), so an idle core notices at once; empty in process."""

    @property
    @abstractmethod
    def worker_pids(self) -> list[int]:
        """The worker processes, rank order; empty when the runner is in this process."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stops every worker (bounded: stragglers are killed); safe to call twice."""
