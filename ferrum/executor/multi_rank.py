"""What the executors with one process per rank share (worker processes, Ray actors): set-up
calls that every rank answers, and a launched step's deferred matchers."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

from ferrum.executor.abstract import Executor
from ferrum.executor.messages import (
    CaptureCudaGraphs,
    DetermineNumKVBlocks,
    FromWorker,
    InitializeKVCache,
    NumKVBlocks,
    ToWorker,
    WarmUp,
)
from ferrum.logger import init_logger
from ferrum.structured_output import StructuredOutputMatcher

logger = init_logger(__name__)


@dataclass(slots=True)
class LaunchedRankStep:
    # The matchers of a step launched with deferred sampling (filled by `sample`), else None.
    deferred_matchers: dict[str, StructuredOutputMatcher] | None = None

    @property
    def awaits_sampling(self) -> bool:
        return self.deferred_matchers is not None


class MultiRankExecutor(Executor):
    """Set-up is one message that every rank answers, in rank order (`_call_all`)."""

    @abstractmethod
    def _call_all(self, message: ToWorker) -> list[FromWorker | None]: ...

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
