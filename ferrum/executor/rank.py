"""One tensor-parallel rank, whatever process hosts it (a worker process of `worker.py` or a Ray
actor of `ray_worker.py`): `start_rank` joins the process group and builds the rank's model
runner; `RankServer.handle` answers the core's messages (`messages.py`) in the order they come.
"""

from __future__ import annotations

from collections import deque

import torch

from ferrum.config import EngineConfig
from ferrum.distributed.parallel_state import init_model_parallel
from ferrum.executor.bitmask_channel import BitmaskReader
from ferrum.executor.messages import (
    CaptureCudaGraphs,
    CompleteStep,
    DetermineNumKVBlocks,
    FromWorker,
    GrammarBitmaskRows,
    InitializeKVCache,
    InlineBitmaskRows,
    LaunchStep,
    NumKVBlocks,
    SampleStep,
    StepOutput,
    ToWorker,
    WarmUp,
    WorkerDone,
)
from ferrum.executor.step_profiler import StepProfiler
from ferrum.model_executor.model_runner import ModelRunner
from ferrum.model_executor.runner_state import LaunchedStep
from ferrum.structured_output import FilledBitmaskRow
from ferrum.structured_output.draft_rows import draft_row_starts


def start_rank(
    config: EngineConfig,
    device: torch.device,
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
) -> ModelRunner:
    """Selects `device`, joins the process group and builds this rank's shard of the model
    (`world_size`: every rank of every pipeline stage)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if config.device_config.num_cpu_threads is not None:
        torch.set_num_threads(config.device_config.num_cpu_threads)
    parallel = config.parallel_config
    if world_size != parallel.world_size:
        raise ValueError(
            f"world_size: {world_size} ranks, but tensor_parallel_size x pipeline_parallel_size "
            f"= {parallel.world_size}"
        )
    tp_group, pp_group = init_model_parallel(
        parallel.tensor_parallel_size,
        parallel.pipeline_parallel_size,
        rank,
        init_method,
        backend,
        custom_all_reduce=not parallel.disable_custom_all_reduce,
        batch_invariant=config.device_config.batch_invariant,
    )
    return ModelRunner(config, device, tp_group, pp_group)


class RankServer:
    """The rank's side of the executor protocol: `handle` runs one message and returns the
    reply the core waits for (None for a message without one: launches, samples, and the
    completion of a step on every rank but the output rank). Exceptions propagate: the host
    reports them and stops."""

    def __init__(
        self, runner: ModelRunner, rank: int, bitmask_reader: BitmaskReader | None = None
    ) -> None:
        self.runner = runner
        self.rank = rank
        # Where GrammarBitmaskRows are (shared memory); None where rows come inline.
        self._bitmask_reader = bitmask_reader
        self._in_flight: deque[LaunchedStep] = deque()
        # Rows still to come for the latest step, launched with deferred sampling.
        self._deferred_rows: list[FilledBitmaskRow] = []
        self._profiler = StepProfiler(rank)
        self._is_output_rank = rank == runner.config.parallel_config.output_rank

    def handle(self, message: ToWorker) -> FromWorker | None:
        runner = self.runner
        match message:
            case LaunchStep(scheduler_output, bitmask, None):
                drafts = scheduler_output.scheduled_spec_decode_tokens
                matchers = self._filled_rows(bitmask, drafts) if bitmask else None
                self._in_flight.append(runner.launch(scheduler_output, matchers))
            case LaunchStep(scheduler_output, _, deferred_req_ids):
                starts, _ = draft_row_starts(
                    deferred_req_ids, scheduler_output.scheduled_spec_decode_tokens
                )
                self._deferred_rows = [FilledBitmaskRow(_NO_ROWS, i) for i in starts]
                matchers = dict(zip(deferred_req_ids, self._deferred_rows))
                step = runner.launch(scheduler_output, matchers, defer_sampling=True)
                self._in_flight.append(step)
            case SampleStep(bitmask):
                rows = self._rows(bitmask)
                for row in self._deferred_rows:
                    row.rows = rows
                step = self._in_flight[-1]
                if step.awaits_sampling:  # else no constrained row sampled: it is sampled
                    runner.sample(step)
            case CompleteStep():
                self._profiler.before_step()
                output = runner.complete(self._in_flight.popleft())
                self._profiler.after_step()
                if self._is_output_rank:
                    return StepOutput(output)
            case DetermineNumKVBlocks():
                return NumKVBlocks(self.rank, runner.determine_num_kv_blocks())
            case InitializeKVCache(num_blocks):
                runner.initialize_kv_cache(num_blocks)
                return WorkerDone(self.rank)
            case WarmUp(num_blocks):
                runner.warm_up(num_blocks)
                return WorkerDone(self.rank)
            case CaptureCudaGraphs():
                runner.capture_cuda_graphs()
                return WorkerDone(self.rank)
            case _:
                raise TypeError(f"rank {self.rank}: unknown message {message!r}")
        return None

    def _rows(self, bitmask: GrammarBitmaskRows | InlineBitmaskRows) -> torch.Tensor:
        if isinstance(bitmask, InlineBitmaskRows):
            return bitmask.rows
        assert self._bitmask_reader is not None, "shared bitmask rows without a reader"
        return self._bitmask_reader.read(bitmask.slot)

    def _filled_rows(
        self, bitmask: GrammarBitmaskRows | InlineBitmaskRows, drafts: dict[str, list[int]]
    ) -> dict[str, FilledBitmaskRow]:
        rows = self._rows(bitmask)
        starts, _ = draft_row_starts(bitmask.req_ids, drafts)
        return {r: FilledBitmaskRow(rows, i) for i, r in zip(starts, bitmask.req_ids)}


# Stands in for the rows of a deferred step until its SampleStep brings them.
_NO_ROWS = torch.empty(0, 0, dtype=torch.int32)
