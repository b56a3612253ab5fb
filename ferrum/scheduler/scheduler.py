"""Continuous batching under one token budget per step: running requests first (decodes and prompt
chunks alike, admission order), then waiting ones while budget, sequence slots and KV blocks last.
Prefill and decode are one path: each request gets `num_scheduled_tokens` toward `num_tokens`. A dry
KV pool preempts the most recently admitted running request (freed, recomputed), never a crash.
A request whose grammar still compiles keeps its place unscheduled; a failed compile aborts it
(`take_failed`); a grammar that ended stops the request with "stop". A request asking for prompt
logprobs takes no prefix-cache hit until they are sent (the prompt's forward computes them)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from ferrum.config import SchedulerConfig
from ferrum.kv.kv_cache_manager import GroupBlockIds, KVCacheManager
from ferrum.request import Request, RequestStatus
from ferrum.scheduler.lora_admission import lora_admits
from ferrum.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ferrum.scheduler.spec_decode import SpecDecodeStats, drafts_to_verify
from ferrum.scheduler.step_plan import StepPlan
from ferrum.scheduler.stop_rules import append_until_stop


@dataclass(slots=True)
class RequestUpdate:
    """What one step did to one request: its new tokens and, if it finished, why."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        pipeline_depth: int = 1,
        num_lookahead_tokens: int = 0,
    ) -> None:
        """`pipeline_depth` > 1 (pipeline parallelism: that many steps in flight at once): a
        request whose next token is still in the pipe is not scheduled (the first stage needs
        the token itself), and a step takes at most 1 / pipeline_depth of the requests, so
        that the steps in flight split them. `num_lookahead_tokens`: KV slots a step that
        samples allocates past its tokens when the pool has them (a draft model's)."""
        if pipeline_depth < 1:
            raise ValueError(f"pipeline_depth: must be >= 1, got {pipeline_depth}")
        self.config = config
        self.pipeline_depth = pipeline_depth
        self.num_lookahead_tokens = num_lookahead_tokens
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # Admission order: the tail is the most recently admitted, the first to be preempted.
        self.running: list[Request] = []
        # Finished since the previous schedule(); the runner forgets them at the next step.
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Requests sent back to the queue outside schedule() (a failed step): the runner must
        # drop their state at the next step.
        self._preempted_req_ids: set[str] = set()
        # Waiting requests whose prefix-cache lookup was already counted in the hit-rate stats.
        self._looked_up: set[str] = set()
        # The requests each scheduled step ran, until its output is applied: with async
        # scheduling a request can finish and its id be reused while a step that ran it is out.
        self._step_requests: dict[int, dict[str, Request]] = {}
        self._num_steps = 0
        # Requests finished by the scheduler outside a step's output (a grammar that failed to
        # compile), with the reason, until `take_failed`.
        self._failed: list[tuple[Request, str]] = []
        self.spec_stats = SpecDecodeStats()

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a request the front end validated: a new id, and it fits the context and the
        KV pool (else it would wait forever)."""
        assert request.req_id not in self.requests, f"request_id {request.req_id!r} is taken"
        limit = min(self.config.max_model_len, self.kv_cache_manager.max_tokens_in_pool())
        assert request.num_prompt_tokens + request.max_tokens <= limit, request
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finishes (e.g. aborts, or stops on a stop string) requests; unknown ids are ignored."""
        assert status.is_finished
        finished = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Takes a request out of its queue and frees it."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
            self._looked_up.discard(request.req_id)
        request.status = status
        self.kv_cache_manager.cache_computed_blocks(request)
        self.kv_cache_manager.free(request)
        self._finished_req_ids.add(request.req_id)
        del self.requests[request.req_id]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.kv_cache_manager.begin_step()
        # Pipeline parallelism: each step in flight takes its share of the requests that can
        # run at once (the running ones and those max_num_seqs still admits).
        runnable = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        step = StepPlan(
            self.config.max_num_batched_tokens,
            -(-max(runnable, len(self.running)) // self.pipeline_depth),
        )
        self._schedule_running(step)
        # A step that had to preempt admits nobody: the pool is already short.
        if not step.preempted:
            self._schedule_waiting(step)
        return self._close_step(step)

    def _schedule_running(self, step: StepPlan) -> None:
        """The running requests' next chunks, in order; preempts from the back when the pool
        runs short."""
        index = 0
        while index < len(self.running) and step.budget > 0 and step.has_room:
            request = self.running[index]
            num_new = min(self._num_tokens_to_compute(request), step.budget)
            if num_new == 0:
                index += 1  # nothing to compute until its next token is known
                continue
            start = request.num_computed_tokens
            num_new = self.kv_cache_manager.chunk_end(request, start, start + num_new) - start
            drafts = drafts_to_verify(request, step.budget, self.config.max_model_len)
            lookahead = self._lookahead(request, start + num_new + len(drafts))
            allocate = self.kv_cache_manager.allocate_slots
            new_block_ids = allocate(request, num_new + len(drafts) + lookahead)
            # Drafts and lookahead never preempt anyone: the lookahead goes first, then drafts.
            if new_block_ids is None and lookahead and drafts:
                new_block_ids = allocate(request, num_new + len(drafts))
            if new_block_ids is None and (lookahead or drafts):
                drafts = []
                new_block_ids = allocate(request, num_new)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted.append(victim)
                if victim is request:
                    break
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is None:
                break
            if drafts:
                step.spec_tokens[request.req_id] = drafts
            step.add(request.req_id, num_new + len(drafts), request.num_computed_tokens)
            step.cached_reqs.append(
                CachedRequestData(request.req_id, new_block_ids, request.num_computed_tokens)
            )
            index += 1

    def _schedule_waiting(self, step: StepPlan) -> None:
        """Admits waiting requests in order while the budget, max_num_seqs and the pool allow;
        those whose grammar still compiles (or whose token is in flight) keep their place."""
        compiling: list[Request] = []
        while (
            self.waiting
            and step.budget > 0
            and len(self.running) < self.config.max_num_seqs
            and step.has_room
        ):
            request = self.waiting[0]
            if request.status == RequestStatus.PREEMPTED and self._has_step_in_flight(request):
                compiling.append(self.waiting.popleft())  # its token comes first
                continue
            if not self._grammar_ready(request) or not self._lora_ready(request):
                if request.is_finished:
                    continue  # _grammar_ready / _lora_ready took it out of the queue
                compiling.append(self.waiting.popleft())
                continue
            computed_blocks: GroupBlockIds | None
            computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(
                request,
                record_stats=request.req_id not in self._looked_up
                and request.prompt_logprobs is None,
            )
            self._looked_up.add(request.req_id)
            if request.prompt_logprobs is not None:
                # Prompt logprobs come from the forward: the whole prompt is computed.
                computed_blocks, num_computed = None, 0
            num_new = min(request.num_tokens - num_computed, step.budget)
            end = self.kv_cache_manager.chunk_end(request, num_computed, num_computed + num_new)
            num_new = end - num_computed
            lookahead = self._lookahead(request, end)
            allocate = self.kv_cache_manager.allocate_slots
            if (
                lookahead == 0 or allocate(request, num_new + lookahead, computed_blocks) is None
            ) and (allocate(request, num_new, computed_blocks) is None):
                break
            self._admit(request, num_computed)
            step.add(request.req_id, num_new, num_computed)
            step.new_reqs.append(
                NewRequestData(
                    req_id=request.req_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(request.req_id),
                    num_computed_tokens=num_computed,
                )
            )
        # Still compiling (or a token in flight): back to the head of the queue, in their order.
        self.waiting.extendleft(reversed(compiling))

    def _lookahead(self, request: Request, end: int) -> int:
        """Lookahead slots for a step computing a request's tokens up to `end` (none unless
        it then samples; never past max_model_len)."""
        if not self.num_lookahead_tokens or end < request.num_tokens:
            return 0
        return max(min(self.num_lookahead_tokens, self.config.max_model_len - end), 0)

    def _admit(self, request: Request, num_computed: int) -> None:
        self.waiting.popleft()
        self._looked_up.discard(request.req_id)
        self.running.append(request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
            request.first_scheduled_time = time.monotonic()

    def _close_step(self, step: StepPlan) -> SchedulerOutput:
        """Advances the scheduled requests as if the step ran (the ones it samples get a
        placeholder) and hands the step out with the finishes and preemptions since the last."""
        self._num_steps += 1
        step_requests = self._step_requests[self._num_steps] = {}
        for req_id, num_new in step.num_scheduled.items():
            request = step_requests[req_id] = self.requests[req_id]
            request.num_computed_tokens = step.computed_before[req_id] + num_new
            num_known = request.num_computed_tokens - len(step.spec_tokens.get(req_id, ()))
            if num_known == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples its next token
        output = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids={r.req_id for r in step.preempted} | self._preempted_req_ids,
            step_id=self._num_steps,
            scheduled_spec_decode_tokens=step.spec_tokens,
        )
        self._finished_req_ids = set()
        self._preempted_req_ids = set()
        return output

    def _num_tokens_to_compute(self, request: Request) -> int:
        """Tokens of a running request that a forward can take now: its known tokens and the one
        a launched step is still sampling (read on the device), none once its length limit is
        reached by the tokens already coming. Under pipeline parallelism only its known tokens:
        one still in the pipe is not on the first stage."""
        if self.pipeline_depth > 1:
            return max(request.num_tokens - request.num_computed_tokens, 0)
        coming = request.num_tokens + request.num_output_placeholders
        if request.num_output_placeholders and (
            request.num_output_tokens + request.num_output_placeholders >= request.max_tokens
            or coming >= self.config.max_model_len
        ):
            return 0
        return coming - request.num_computed_tokens

    def has_drafts(self) -> bool:
        """Whether a running request holds drafts to verify (speculative decoding)."""
        return any(r.spec_token_ids for r in self.running)

    def _has_step_in_flight(self, request: Request) -> bool:
        """Whether a launched, not yet completed step samples for `request`: a request preempted
        while its token was in the pipe (two or more steps in flight: pipeline parallelism)
        waits for that token before it is admitted again, or the recompute would miss it."""
        return any(reqs.get(request.req_id) is request for reqs in self._step_requests.values())

    def needs_host_history(self) -> bool:
        """True when a running request samples from its exact output history on the host
        (penalties, bad words): the previous step's tokens must arrive before the next step is
        scheduled. (A grammar's matcher catches up while the next forward runs: see core.py.)"""
        return any(
            r.sampling_params.uses_penalties or r.sampling_params.bad_words_token_ids
            for r in self.running
        )

    def _grammar_ready(self, request: Request) -> bool:
        """True unless the request's grammar is still compiling or failed to (then the request
        is finished, aborted, and kept for `take_failed`)."""
        if request.grammar is None:
            return True
        try:
            return request.grammar.poll(request.output_token_ids)
        except Exception as e:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._failed.append((request, str(e) or type(e).__name__))
            return False

    def _lora_ready(self, request: Request) -> bool:
        """`lora_admits`; a request whose adapter failed to load is finished, aborted, and kept
        for `take_failed`."""
        try:
            return lora_admits(request, self.running)
        except Exception as e:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            self._failed.append((request, str(e) or type(e).__name__))
            return False

    def take_failed(self) -> list[tuple[Request, str]]:
        """The requests finished since the previous call because their grammar failed, and why."""
        failed, self._failed = self._failed, []
        return failed

    def recover_from_failed_step(self, scheduler_output: SchedulerOutput) -> None:
        """After a forward that did not finish: no KV of that step exists, so the prefix-cache
        entries of every unfinished step are dropped and every request it scheduled is recomputed
        from scratch later."""
        self.kv_cache_manager.discard_step_cache()
        # The runner may have failed before reading them: tell it again next step (harmless twice).
        self._finished_req_ids |= scheduler_output.finished_req_ids
        self._preempted_req_ids |= scheduler_output.preempted_req_ids
        # Newest first, each to the head of the queue: they keep their admission order.
        for request in reversed(self._step_requests.pop(scheduler_output.step_id, {}).values()):
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._preempt(request)
                self._preempted_req_ids.add(request.req_id)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Appends sampled tokens, applies token-level stop rules, frees finished requests.

        Steps complete in launch order. A request preempted after its step was launched (async
        scheduling) still takes the token: it is recomputed with it, as if sampled before."""
        self.kv_cache_manager.end_step()
        step_requests = self._step_requests.pop(scheduler_output.step_id, {})
        spec = runner_output.spec_decode
        verified = scheduler_output.scheduled_spec_decode_tokens
        updates = []
        for req_id, token_id in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = step_requests.get(req_id)
            if request is None or request.is_finished:
                continue  # finished or aborted while the step ran
            if request.num_output_placeholders:  # 0 once preempted
                request.num_output_placeholders -= 1
            token_ids = [token_id]
            if spec is not None:
                accepted = spec.accepted_token_ids.get(req_id, [])
                token_ids = accepted + token_ids
                if req_id in verified:
                    num_drafts = len(verified[req_id])
                    self.spec_stats.observe(num_drafts, len(accepted))
                    if request.status == RequestStatus.RUNNING:
                        request.num_computed_tokens -= num_drafts - len(accepted)
            token_ids, status = append_until_stop(request, token_ids, self.config.max_model_len)
            if status is not None:
                self._finish(request, status)
            updates.append(RequestUpdate(request, token_ids, status is not None))
            if not request.is_finished:  # drafts from this step's tokens, or none
                request.spec_token_ids = (
                    [] if spec is None else spec.draft_token_ids.get(req_id, [])
                )
        return updates
