"""EngineCore: scheduler + model runner, token ids in and token ids out.

It knows nothing of text: tokenization, detokenization, stop strings and `n` fan-out live in the
front end (`LLMEngine`, the API server), so the core can run in its own process and keep the
device busy while the front end handles HTTP and text.
"""

from __future__ import annotations

import time

import torch

from ferrum.config import EngineConfig
from ferrum.engine.core_output import EngineCoreOutput, SchedulerStats
from ferrum.engine.request import Request, RequestStatus
from ferrum.kv.kv_cache_manager import KVCacheManager
from ferrum.logger import init_logger
from ferrum.model_executor.model_runner import ModelRunner
from ferrum.scheduler.scheduler import Scheduler

logger = init_logger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        device = torch.device(config.device_config.device)
        self.runner = ModelRunner(config, device)
        loaded = time.perf_counter()
        num_blocks = config.cache_config.num_kv_blocks or self.runner.determine_num_kv_blocks()
        self.runner.initialize_kv_cache(num_blocks)
        sized = time.perf_counter()
        self.runner.warm_up(num_blocks)
        self.runner.capture_cuda_graphs()
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.cache_config.block_size, config.cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler_config, self.kv_cache_manager)
        self.startup_seconds = time.perf_counter() - start
        logger.info(
            "engine core ready in %.2f s (model load %.2f s, KV cache sizing %.2f s, warm-up and "
            "CUDA graphs %.2f s): %s on %s, %s, %s kernels, %d KV blocks of %d tokens",
            self.startup_seconds,
            loaded - start,
            sized - loaded,
            start + self.startup_seconds - sized,
            config.model_config.architecture,
            device,
            config.model_config.dtype,
            self.runner.kernel_backend,
            self.kv_cache_manager.num_usable_blocks,
            config.cache_config.block_size,
        )

    def check_request_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        self.scheduler.check_request_fits(num_prompt_tokens, max_tokens)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def finish_requests(
        self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Aborts (or stops, for stop strings) requests; their blocks return to the pool now."""
        self.scheduler.finish_requests(req_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        # An empty step still tells the runner which requests finished.
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except BaseException:
            self.scheduler.recover_from_failed_step(scheduler_output)
            raise
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        logprobs = (
            dict(zip(runner_output.req_ids, runner_output.logprobs))
            if runner_output.logprobs is not None
            else {}
        )
        return [
            EngineCoreOutput(
                req_id=u.request.req_id,
                new_token_ids=u.new_token_ids,
                finish_reason=u.request.status.finish_reason if u.finished else None,
                stop_reason=u.request.stop_reason,
                logprobs=logprobs.get(u.request.req_id),
                num_cached_tokens=max(u.request.num_cached_tokens, 0),
            )
            for u in updates
        ]

    def stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )
