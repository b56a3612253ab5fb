"""One rank, in this process: the executor is the model runner itself, unchanged."""

from __future__ import annotations

from typing import Any

import torch

from ferrum.config import EngineConfig
from ferrum.executor.abstract import Executor
from ferrum.model_executor.model_runner import ModelRunner
from ferrum.model_executor.runner_state import LaunchedStep
from ferrum.scheduler.output import ModelRunnerOutput, SchedulerOutput
from ferrum.structured_output import StructuredOutputMatcher


class UniProcExecutor(Executor):
    """Forwards every call to the in-process `runner` (one Python call per step on top of it)."""

    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config, torch.device(config.device_config.device))
        self.kernel_backend = self.runner.kernel_backend

    def determine_num_kv_blocks(self) -> list[int]:
        return self.runner.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int | list[int]) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def warm_up(self, num_blocks: int | list[int]) -> None:
        self.runner.warm_up(num_blocks)

    def capture_cuda_graphs(self) -> None:
        self.runner.capture_cuda_graphs()

    def launch(
        self,
        scheduler_output: SchedulerOutput,
        matchers: dict[str, StructuredOutputMatcher] | None = None,
        defer_sampling: bool = False,
    ) -> LaunchedStep:
        return self.runner.launch(scheduler_output, matchers, defer_sampling)

    def sample(self, launched: LaunchedStep) -> None:
        self.runner.sample(launched)

    def complete(self, launched: LaunchedStep) -> ModelRunnerOutput:
        return self.runner.complete(launched)

    def check_health(self) -> None:
        return None

    @property
    def failure_sentinels(self) -> list[Any]:
        return []

    @property
    def worker_pids(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        return None
