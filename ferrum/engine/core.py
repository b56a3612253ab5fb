"""EngineCore: scheduler + executor, token ids in and out. Text (tokenizing, detokenizing, stop
strings, `n` fan-out) lives in the front end, so the core can run in its own process and keep the
device busy; only grammars compile here (a request waits unscheduled until its grammar has).
Structured outputs under async scheduling: a step's bitmask needs every earlier token accepted, so
a step sampling a constrained request launches its forward alone and stays in flight when `step`
returns; the next call completes it (its tokens reach the matchers), fills the mask, queues the
sampling and the next forward right after, so processing, scheduling and the fill overlap the
forward; tokens equal synchronous scheduling's. Penalties and bad words still wait for the
previous step (`Scheduler.needs_host_history`)."""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections import deque
from typing import Any

import torch

from ferrum import envs
from ferrum.config import EngineConfig, snapshot_interval_blocks
from ferrum.engine.core_messages import (
    ITERATION_TOKENS_BUCKETS,
    EngineCoreOutput,
    EngineCoreRequest,
    SchedulerStats,
)
from ferrum.engine.fault_injection import with_injected_faults
from ferrum.engine.grammar_frontend import tokenizer_info_builder
from ferrum.engine.input_processor import load_tokenizer
from ferrum.executor import Executor, create_executor
from ferrum.kv.kv_cache_manager import KVCacheManager
from ferrum.logger import init_logger
from ferrum.lora.loads import lora_loads
from ferrum.model_executor.kv_cache_sizing import kv_cache_group_specs
from ferrum.request import Logprobs, Request, RequestStatus
from ferrum.scheduler.lora_admission import lora_adapter_stats
from ferrum.scheduler.output import ModelRunnerOutput, SchedulerOutput
from ferrum.scheduler.scheduler import Scheduler
from ferrum.speculative_config import num_lookahead_tokens
from ferrum.structured_output import StructuredOutputMatcher
from ferrum.structured_output.manager import RequestGrammar, StructuredOutputManager

logger = init_logger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        core_index: int = 0,
        grammars: StructuredOutputManager | None = None,
    ) -> None:
        """`core_index`: 0 for a front end's first core, n for its nth restart. `grammars`: a
        manager shared with an in-process front end (default: the core's own)."""
        self.config = config
        self.grammars = grammars or StructuredOutputManager(
            config.structured_outputs_config,
            tokenizer_info_builder(
                config.model_config, lambda: load_tokenizer(config.model_config)
            ),
        )
        start = time.perf_counter()
        if config.device_config.num_cpu_threads is not None:
            torch.set_num_threads(config.device_config.num_cpu_threads)
        device = torch.device(config.device_config.device)
        _warn_if_cpu_threads_spin(device)
        executor = create_executor(config)
        try:
            self.executor: Executor = with_injected_faults(executor, core_index)
            loaded = time.perf_counter()
            num_blocks = (
                config.cache_config.num_kv_blocks or self.executor.determine_num_kv_blocks()
            )
            self.executor.initialize_kv_cache(num_blocks)
            sized = time.perf_counter()
            self.executor.warm_up(num_blocks)
            self.executor.capture_cuda_graphs()
        except BaseException:
            executor.shutdown()
            raise
        # Pipeline parallelism keeps one step in flight per stage (the requests split between
        # them); otherwise async scheduling keeps one.
        self.pipeline_depth = config.parallel_config.pipeline_parallel_size
        self.loras = lora_loads(config)  # LoRA adapters, loaded off the step loop
        self.scheduler = _make_scheduler(config, num_blocks)
        self.kv_cache_manager = self.scheduler.kv_cache_manager
        self.async_scheduling = config.scheduler_config.async_scheduling
        # Launched steps not completed yet, oldest first (between calls of `step`: at most one,
        # which may await its deferred sampling, or pipeline_depth - 1).
        self._in_flight: deque[tuple[SchedulerOutput, Any]] = deque()
        # Outputs of completed steps not yet returned by `step`.
        self._completed_outputs: list[EngineCoreOutput] = []
        # Non-empty steps per ITERATION_TOKENS_BUCKETS bucket (+ one for larger), their tokens.
        self._iteration_tokens_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self._iteration_tokens_sum = 0
        # The requests of the step(s) lost when the latest `step` raised, sorted.
        self.failed_step_req_ids: list[str] = []
        self.startup_seconds = time.perf_counter() - start
        logger.info(
            "engine core ready in %.2f s (model load %.2f s, KV cache sizing %.2f s, warm-up and "
            "CUDA graphs %.2f s): %s on %s x %d, %s, %s kernels, %d KV blocks of %d tokens, %s "
            "scheduling",
            self.startup_seconds,
            loaded - start,
            sized - loaded,
            start + self.startup_seconds - sized,
            config.model_config.architecture,
            device,
            config.parallel_config.world_size,
            config.model_config.dtype,
            self.executor.kernel_backend,
            self.kv_cache_manager.num_usable_blocks,
            config.cache_config.block_size,
            "async" if config.scheduler_config.async_scheduling else "synchronous",
        )

    def add_request(self, r: EngineCoreRequest) -> None:
        """Builds the core's own `Request` from one the front end validated. A resumed
        request's earlier output tokens are its outputs here too (length limits,
        min_tokens, penalties, its seeded generator): it continues like a preempted one."""
        args = (r.req_id, r.prompt_token_ids, r.sampling_params, r.eos_token_id, r.arrival_time)
        request = Request(*args)
        for token_id in r.output_token_ids:
            request.append_output_token(token_id)
        if r.output_token_ids:
            request.prompt_logprobs = None  # the front end has them
        if r.sampling_params.structured_outputs is not None:
            budget = r.grammar_max_tokens or request.max_tokens
            request.grammar = RequestGrammar(
                self.grammars.submit(r.sampling_params.structured_outputs), max_tokens=budget
            )
        if r.lora_request is not None:
            assert self.loras is not None, "the front end refuses adapters without enable_lora"
            request.lora = self.loras.handle(r.lora_request)
        self.scheduler.add_request(request)

    def finish_requests(
        self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        """Aborts (or stops, for stop strings) requests; their blocks return to the pool now."""
        self.scheduler.finish_requests(req_ids, status)

    def has_unfinished_requests(self) -> bool:
        """Requests still running or waiting, or outputs not yet returned by `step`."""
        return self.scheduler.has_unfinished_requests() or bool(self._completed_outputs)

    def step(self) -> list[EngineCoreOutput]:
        """Schedules and launches one step; returns the outputs of the steps completed meanwhile:
        the step just launched (synchronous), or the previous call's step, completed once this one
        is queued (async scheduling: outputs lag one call, so the host works while the device
        computes). Pipeline parallelism: the oldest step once pipeline_depth are in flight or when
        nothing was scheduled. Outputs of steps completed before an exception come next call."""
        self.failed_step_req_ids = []
        pipelined = self.pipeline_depth > 1
        if not pipelined and self._in_flight and self._needs_previous_tokens():
            self._sample_deferred()
            self._complete_oldest()
        # An empty step still tells the runner which requests finished.
        scheduler_output = self.scheduler.schedule()
        if self.loras is not None:
            scheduler_output.lora = self.loras.step_data(scheduler_output, self.scheduler.requests)
        if logger.isEnabledFor(logging.DEBUG) and not scheduler_output.is_empty:
            logger.debug(
                "step %d: %d requests (%d new), %d tokens",
                scheduler_output.step_id,
                len(scheduler_output.num_scheduled_tokens),
                len(scheduler_output.scheduled_new_reqs),
                scheduler_output.total_num_scheduled_tokens,
            )
        if not scheduler_output.is_empty:
            num_tokens = scheduler_output.total_num_scheduled_tokens
            self._iteration_tokens_counts[bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
            self._iteration_tokens_sum += num_tokens
        self._report_failed()
        if scheduler_output.is_empty and not self._in_flight and self._waiting_on_grammars():
            time.sleep(_GRAMMAR_POLL_SECONDS)  # nothing to run until a compile ends
        try:
            self._sample_deferred()
        except BaseException:
            self._record_failed_steps([scheduler_output])
            self.scheduler.recover_from_failed_step(scheduler_output)
            raise
        try:
            launched = self.executor.launch(
                scheduler_output,
                self._matchers(scheduler_output),
                defer_sampling=bool(self._in_flight) and not pipelined,
            )
        except BaseException:
            self._record_failed_steps([scheduler_output])
            try:
                while self._in_flight:  # launched before the failure: may be intact
                    self._complete_oldest()
            finally:
                self.scheduler.recover_from_failed_step(scheduler_output)
            raise
        self._in_flight.append((scheduler_output, launched))
        if pipelined:
            if len(self._in_flight) >= self.pipeline_depth or scheduler_output.is_empty:
                self._complete_oldest()
        # A step awaiting its sampling stays in flight (launched deferred: one was before it).
        elif not self.async_scheduling or len(self._in_flight) > 1:
            self._complete_oldest()
        outputs, self._completed_outputs = self._completed_outputs, []
        return outputs

    def _needs_previous_tokens(self) -> bool:
        """Whether the step in flight must complete before the next is scheduled: synchronous
        scheduling, penalties or bad words, and speculative decoding while a request holds
        drafts (they follow its last token, which must be known) or the step verifies some."""
        if not self.async_scheduling or self.scheduler.needs_host_history():
            return True
        if self.config.speculative_config is None:
            return False
        return bool(self._in_flight[-1][0].scheduled_spec_decode_tokens) or (
            self.scheduler.has_drafts()
        )

    def _sample_deferred(self) -> None:
        """Queues the sampling of the newest step in flight if it awaits it. Its matchers are up
        to date: the step before it completed in the call that launched it."""
        if not self._in_flight or not self._in_flight[-1][1].awaits_sampling:
            return
        scheduler_output, launched = self._in_flight[-1]
        try:
            self.executor.sample(launched)
        except BaseException:
            self._record_failed_steps([scheduler_output])
            self._in_flight.pop()
            self.scheduler.recover_from_failed_step(scheduler_output)
            raise

    def _matchers(self, scheduler_output: SchedulerOutput) -> dict[str, StructuredOutputMatcher]:
        """The matchers of the scheduled requests that have a grammar (the runner masks the
        rows among them that sample this step)."""
        requests = self.scheduler.requests
        matchers = {}
        for req_id in scheduler_output.num_scheduled_tokens:
            grammar = requests[req_id].grammar
            if grammar is not None and grammar.matcher is not None:
                matchers[req_id] = grammar.matcher
        return matchers

    def _waiting_on_grammars(self) -> bool:
        return any(
            (r.grammar is not None and r.grammar.matcher is None)
            or (r.lora is not None and r.lora.loading)
            for r in self.scheduler.waiting
        )

    def _report_failed(self) -> None:
        for request, reason in self.scheduler.take_failed():
            logger.warning("request %s aborted: %s", request.req_id, reason)
            self._completed_outputs.append(
                EngineCoreOutput(req_id=request.req_id, new_token_ids=[], finish_reason="abort")
            )

    def _complete_oldest(self) -> None:
        """Waits for the oldest launched step and applies its tokens. If the device failed, every
        launched step's work is lost and their requests are requeued."""
        scheduler_output, launched = self._in_flight[0]
        try:
            runner_output = self.executor.complete(launched)
        except BaseException:
            self._record_failed_steps([step for step, _ in self._in_flight])
            for failed, _ in self._in_flight:
                self.scheduler.recover_from_failed_step(failed)
            self._in_flight.clear()
            raise
        self._in_flight.popleft()
        if runner_output.prompt_logprobs:
            self._collect_prompt_logprobs(runner_output.prompt_logprobs)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        logprobs = token_logprobs(runner_output)
        self._completed_outputs.extend(
            EngineCoreOutput(
                req_id=u.request.req_id,
                new_token_ids=u.new_token_ids,
                finish_reason=u.request.status.finish_reason if u.finished else None,
                stop_reason=u.request.stop_reason,
                logprobs=_first(logprobs.get(u.request.req_id), len(u.new_token_ids)),
                prompt_logprobs=_take_prompt_logprobs(u.request),
                num_cached_tokens=max(u.request.num_cached_tokens, 0),
                first_scheduled_time=u.request.first_scheduled_time,
            )
            for u in updates
        )

    def _collect_prompt_logprobs(self, chunks: dict[str, tuple[int, list[Logprobs]]]) -> None:
        """Appends each chunk's positions that its request has not collected yet (a request
        recomputed after a preemption scores its prompt again)."""
        for req_id, (first_position, entries) in chunks.items():
            request = self.scheduler.requests.get(req_id)
            if request is None or request.prompt_logprobs is None:
                continue
            skip = len(request.prompt_logprobs) + 1 - first_position
            assert skip >= 0, "prompt logprobs arrive in position order"
            request.prompt_logprobs.extend(entries[skip:])

    def _record_failed_steps(self, steps: list[SchedulerOutput]) -> None:
        """Adds the requests of `steps` to `failed_step_req_ids`: a launch that raised names its
        own step; a device failure surfacing at completion names every step still in flight."""
        req_ids = set(self.failed_step_req_ids)
        for step in steps:
            req_ids.update(step.num_scheduled_tokens)
        self.failed_step_req_ids = sorted(req_ids)

    def check_health(self) -> None:
        """Raises if a worker of the executor has failed (never blocks)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stops the executor's workers (bounded); the core is unusable afterwards."""
        if self.loras is not None:
            self.loras.shutdown()
        self.executor.shutdown()

    def stats(self) -> SchedulerStats:
        kv, spec = self.kv_cache_manager, self.scheduler.spec_stats
        return SchedulerStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            iteration_tokens_counts=tuple(self._iteration_tokens_counts),
            iteration_tokens_sum=self._iteration_tokens_sum,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_position=tuple(spec.accepted_per_position),
            **lora_adapter_stats(self.scheduler.running, self.scheduler.waiting),
        )


def token_logprobs(output: ModelRunnerOutput) -> dict[str, list[Logprobs]]:
    """Each request's logprobs of the step's tokens, in token order (accepted drafts first)."""
    if output.logprobs is None:
        return {}
    accepted = {} if output.spec_decode is None else output.spec_decode.accepted_logprobs
    return {
        req_id: [*accepted.get(req_id, ()), entry]
        for req_id, entry in zip(output.req_ids, output.logprobs)
        if entry is not None
    }


def _first(entries: list[Logprobs] | None, n: int) -> list[Logprobs] | None:
    """The entries of a request's first n new tokens (the later ones came after its stop)."""
    return None if entries is None else entries[:n]


def _make_scheduler(config: EngineConfig, num_blocks: int | list[int]) -> Scheduler:
    """The scheduler over a KV cache manager of `num_blocks` (per layer group)."""
    kv_cache_manager = KVCacheManager(
        num_blocks,
        config.cache_config.block_size,
        config.cache_config.enable_prefix_caching,
        groups=kv_cache_group_specs(config.model_config),
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        snapshot_interval_blocks=snapshot_interval_blocks(config.cache_config),
    )
    return Scheduler(
        config.scheduler_config,
        kv_cache_manager,
        config.parallel_config.pipeline_parallel_size,
        num_lookahead_tokens(config.speculative_config),
    )


def _take_prompt_logprobs(request: Request) -> list[Logprobs] | None:
    """The request's prompt logprobs, once its first output token exists (then they are sent
    and forgotten here)."""
    collected = request.prompt_logprobs
    if collected is None or not request.output_token_ids:
        return None
    assert len(collected) == request.num_prompt_tokens - 1
    request.prompt_logprobs = None
    return collected


# How long an idle step sleeps while a request waits for its grammar.
_GRAMMAR_POLL_SECONDS = 0.002


def _warn_if_cpu_threads_spin(device: torch.device) -> None:
    """On the CPU, torch's threads spinning while idle slow every step on shared cores."""
    if device.type == "cpu" and torch.get_num_threads() > 1 and envs.openmp_spins():
        logger.warning(
            "torch's %d CPU threads spin while idle (OMP_WAIT_POLICY is not PASSIVE: torch "
            "was imported before ferrum, or it was set): on cores other work shares, steps "
            "can be several times slower; set OMP_WAIT_POLICY=PASSIVE or --num-cpu-threads 1",
            torch.get_num_threads(),
        )
