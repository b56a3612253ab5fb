"""Every message between the engine core and its workers (`ToWorker`, `FromWorker`), pickled once.
Set-up messages wait for every rank's reply (`NumKVBlocks` or `WorkerDone`). Steps flow without
replies: `LaunchStep` queues one (with `deferred_req_ids`, its forward only; `SampleStep` brings
their bitmask rows), `CompleteStep` waits for the oldest, answered by rank 0 alone (`StepOutput`).
A rank that raises answers `WorkerFailed`, at any point, and stops serving."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum.executor.bitmask_channel import BitmaskSlot
from ferrum.scheduler.output import ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True)
class DetermineNumKVBlocks:
    pass


@dataclass(slots=True)
class InitializeKVCache:
    num_blocks: int | list[int]


@dataclass(slots=True)
class WarmUp:
    num_blocks: int | list[int]


@dataclass(slots=True)
class CaptureCudaGraphs:
    pass


@dataclass(slots=True)
class GrammarBitmaskRows:
    """Next-token bitmask rows the core filled from its matchers into shared memory
    (bitmask_channel.py): row `i` of `slot` belongs to `req_ids[i]`."""

    req_ids: list[str]
    slot: BitmaskSlot


@dataclass(slots=True)
class InlineBitmaskRows:
    """Next-token bitmask rows carried in the message itself (the Ray executor, whose ranks may
    be on other hosts): row `i` of `rows` (int32, [len(req_ids), vocab words]) belongs to
    `req_ids[i]`."""

    req_ids: list[str]
    rows: torch.Tensor


@dataclass(slots=True)
class LaunchStep:
    scheduler_output: SchedulerOutput
    grammar_bitmask: GrammarBitmaskRows | InlineBitmaskRows | None = None
    # The constrained requests of a step whose sampling waits for SampleStep (their rows).
    deferred_req_ids: list[str] | None = None


@dataclass(slots=True)
class SampleStep:
    """The rows of the latest LaunchStep's `deferred_req_ids`, in that order."""

    grammar_bitmask: GrammarBitmaskRows | InlineBitmaskRows


@dataclass(slots=True)
class CompleteStep:
    pass


@dataclass(slots=True)
class ShutdownWorker:
    pass


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """The rank built its model runner."""

    rank: int
    kernel_backend: str


@dataclass(frozen=True, slots=True)
class NumKVBlocks:
    rank: int
    num_blocks: list[int]  # per KV cache layer group


@dataclass(frozen=True, slots=True)
class WorkerDone:
    rank: int


@dataclass(slots=True)
class StepOutput:
    output: ModelRunnerOutput


@dataclass(frozen=True, slots=True)
class WorkerFailed:
    rank: int
    # The exception, formatted with its traceback.
    error: str


ToWorker = (
    DetermineNumKVBlocks
    | InitializeKVCache
    | WarmUp
    | CaptureCudaGraphs
    | LaunchStep
    | SampleStep
    | CompleteStep
    | ShutdownWorker
)
FromWorker = WorkerReady | NumKVBlocks | WorkerDone | StepOutput | WorkerFailed
