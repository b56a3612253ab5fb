"""What the executors with one process per rank share (worker processes, Ray actors): set-up
calls that every rank answers, and the launch and deferred sampling of a step, which differ
only in how a message reaches the ranks and where a step's bitmask rows travel."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field

from ferrum.executor.abstract import Executor, WorkerStepError
from ferrum.executor.messages import (
    CaptureCudaGraphs,
    DetermineNumKVBlocks,
    FromWorker,
    GrammarBitmaskRows,
    InitializeKVCache,
    InlineBitmaskRows,
    LaunchStep,
    NumKVBlocks,
    SampleStep,
    ToWorker,
    WarmUp,
)
from ferrum.logger import init_logger
from ferrum.scheduler.output import SchedulerOutput
from ferrum.structured_output import StructuredOutputMatcher

logger = init_logger(__name__)


@dataclass(slots=True)
class LaunchedRankStep:
    # The matchers of a step launched with deferred sampling (filled by `sample`), else None.
    deferred_matchers: dict[str, StructuredOutputMatcher] | None = None
    # The drafts its requests verify (their rows follow each draft: `draft_rows.py`).
    drafts: dict[str, list[int]] = field(default_factory=dict)

    @property
    def awaits_sampling(self) -> bool:
        return self.deferred_matchers is not None


class MultiRankExecutor(Executor):
    """Set-up is one message that every rank answers, in rank order (`_call_all`)."""

    @abstractmethod
    def _call_all(self, message: ToWorker) -> list[FromWorker | None]: ...

    @abstractmethod
    def _send_launch(self, message: LaunchStep) -> None:
        """Queues a launch for every rank (it may travel with the next message); raises the
        executor's failure if it has one."""

    @abstractmethod
    def _send(self, message: ToWorker) -> None:
        """Sends a message to every rank now."""

    @abstractmethod
    def _fill_bitmask(
        self, matchers: dict[str, StructuredOutputMatcher], drafts: dict[str, list[int]]
    ) -> GrammarBitmaskRows | InlineBitmaskRows:
        """The rows of `matchers`' requests (one after each of its `drafts` too, laid out as
        `draft_rows.py` says), filled now, where the ranks can read them."""

    @abstractmethod
    def _fail(self, error: RuntimeError) -> RuntimeError:
        """Records the first failure and stops every rank; returns the error to raise."""

    def launch(
        self,
        scheduler_output: SchedulerOutput,
        matchers: dict[str, StructuredOutputMatcher] | None = None,
        defer_sampling: bool = False,
    ) -> LaunchedRankStep:
        """A deferred step with constrained requests always `awaits_sampling` here: a rank
        whose runner sampled it already (no constrained row samples) ignores the rows."""
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if matchers and defer_sampling:
            self._send_launch(LaunchStep(scheduler_output, None, list(matchers)))
            return LaunchedRankStep(matchers, drafts)
        bitmask = self._fill_bitmask(matchers, drafts) if matchers else None
        self._send_launch(LaunchStep(scheduler_output, bitmask))
        return LaunchedRankStep()

    def sample(self, launched: LaunchedRankStep) -> None:
        matchers, launched.deferred_matchers = launched.deferred_matchers, None
        assert matchers is not None, "the step was sampled already"
        try:
            message = SampleStep(self._fill_bitmask(matchers, launched.drafts))
        except BaseException as e:
            # The ranks hold the step's forward, waiting for its rows: nothing can end it.
            error = WorkerStepError(f"filling a deferred step's bitmask failed: {e!r}")
            raise self._fail(error) from e
        self._send(message)

    def determine_num_kv_blocks(self) -> list[int]:
        """Per layer group, the fewest blocks any rank can hold."""
        replies = self._call_all(DetermineNumKVBlocks())
        sizes = [list(r.num_blocks) for r in replies if isinstance(r, NumKVBlocks)]
        assert len(sizes) == len(replies)
        counts = [min(group) for group in zip(*sizes, strict=True)]
        if any(size != counts for size in sizes):
            logger.info("KV blocks per rank %s: every rank uses %s", sizes, counts)
        return counts

    def initialize_kv_cache(self, num_blocks: int | list[int]) -> None:
        self._call_all(InitializeKVCache(num_blocks))

    def warm_up(self, num_blocks: int | list[int]) -> None:
        self._call_all(WarmUp(num_blocks))

    def capture_cuda_graphs(self) -> None:
        self._call_all(CaptureCudaGraphs())
