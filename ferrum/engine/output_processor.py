"""Turns per-step token updates into RequestOutputs: detokenization, stop strings, logprobs, n. A
user request with `n > 1` runs as n child requests in the scheduler, their outputs gathered here
under the parent's id, in index order. Each child's detokenizer holds its one list of output token
ids; an output is a delta of it, a copy (CUMULATIVE), or, once the request is finished and
forgotten here, the list itself."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ferrum.engine.core_messages import EngineCoreOutput
from ferrum.engine.detokenizer import IncrementalDetokenizer
from ferrum.engine.input_processor import ProcessedPrompt, ProcessedRequest
from ferrum.engine.tokenizer import Tokenizer
from ferrum.errors import FieldError
from ferrum.lora_request import LoRARequest
from ferrum.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
)
from ferrum.request import Logprobs
from ferrum.sampling_params import RequestOutputKind


@dataclass(slots=True)
class _ChildState:
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Output tokens already returned (DELTA outputs only).
    num_sent_tokens: int = 0
    # When this completion's latest new tokens arrived (None before its first).
    last_token_time: float | None = None


@dataclass(slots=True)
class _ParentState:
    request_id: str
    prompt: ProcessedPrompt
    children: dict[str, _ChildState]
    output_kind: RequestOutputKind
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    # prompt_logprobs once a completion brought them; `prompt_logprobs_sent`: in a DELTA output.
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    lora_request: LoRARequest | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._parent_of: dict[str, _ParentState] = {}

    def add_request(self, request: ProcessedRequest) -> None:
        """Tracks a request's completions (in index order); raises FieldError("request_id") if
        its id, or one of its completions' ids, is taken: the one duplicate check."""
        request_id = request.request_id
        taken = next((r.req_id for r in request.core_requests if self.has_request(r.req_id)), None)
        if self.has_request(request_id):
            raise FieldError("request_id", f"request_id {request_id!r} is already in use")
        if taken is not None:
            raise FieldError(
                "request_id", f"request_id {request_id!r} collides with request {taken!r}"
            )
        params = request.params
        children = {}
        for index, core_request in enumerate(request.core_requests):
            detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt.token_ids, params)
            child = _ChildState(index=index, detokenizer=detokenizer)
            if params.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            children[core_request.req_id] = child
        metrics = RequestMetrics(request.arrival_time)
        parent = _ParentState(request_id, request.prompt, children, request.output_kind, metrics)
        parent.lora_request = request.core_requests[0].lora_request
        self._parents[request_id] = parent
        for child_id in children:
            self._parent_of[child_id] = parent

    def has_request(self, request_id: str) -> bool:
        """Whether the id is taken, as a request's or as one of its completions' internal id."""
        return request_id in self._parents or request_id in self._parent_of

    def parent_id(self, child_id: str) -> str | None:
        """The request a completion belongs to (None once it is finished or unknown)."""
        parent = self._parent_of.get(child_id)
        return None if parent is None else parent.request_id

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return list(parent.children) if parent else []

    def process(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of the parents that changed, and child ids that hit a stop string.

        Outputs for children already finished here (e.g. by a stop string while the core ran
        one more step) are dropped.
        """
        now = time.monotonic()
        changed: dict[str, _ParentState] = {}
        stopped_by_string: list[str] = []
        for core_output in core_outputs:
            parent = self._parent_of.get(core_output.req_id)
            if parent is None:
                continue
            child = parent.children[core_output.req_id]
            if child.finish_reason is not None:
                continue
            self._record_times(parent.metrics, child, core_output, now)
            parent.num_cached_tokens = max(parent.num_cached_tokens, core_output.num_cached_tokens)
            if core_output.prompt_logprobs is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = [None]
                parent.prompt_logprobs.extend(map(self._logprob_entry, core_output.prompt_logprobs))
            stop_terminated = core_output.finish_reason == "stop"
            num_before = len(child.detokenizer.token_ids)
            stop_string = child.detokenizer.update(core_output.new_token_ids, stop_terminated)
            # A stop string drops the step's tokens after it, and their logprobs.
            num_kept = len(child.detokenizer.token_ids) - num_before
            self._add_logprobs(child, core_output.logprobs, num_kept)
            if stop_string is not None:
                # A stop string wins over the core's reason for the same token (e.g. "length").
                child.finish_reason, child.stop_reason = "stop", stop_string
                if core_output.finish_reason is None:
                    stopped_by_string.append(core_output.req_id)
            elif core_output.finish_reason is not None:
                child.finish_reason = core_output.finish_reason
                child.stop_reason = core_output.stop_reason
            changed[parent.request_id] = parent
        outputs = [
            self._make_output(parent, now)
            for parent in changed.values()
            if parent.output_kind is not RequestOutputKind.FINAL_ONLY or parent.finished
        ]
        return outputs, stopped_by_string

    @staticmethod
    def _record_times(
        metrics: RequestMetrics, child: _ChildState, core_output: EngineCoreOutput, now: float
    ) -> None:
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = core_output.first_scheduled_time
        if not core_output.new_token_ids:
            return
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if child.last_token_time is not None:
            metrics.inter_token_latencies.append(now - child.last_token_time)
        child.last_token_time = metrics.last_token_time = now

    def abort(self, request_id: str) -> RequestOutput | None:
        """Marks every unfinished child aborted and returns the final output."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children.values():
            if child.finish_reason is None:
                child.finish_reason = "abort"
        return self._make_output(parent, time.monotonic())

    def _add_logprobs(
        self, child: _ChildState, entries: list[Logprobs] | None, num_tokens: int
    ) -> None:
        """Appends one step's entries of its first `num_tokens` new tokens (one per token)."""
        if child.logprobs is None or entries is None:
            return
        for step in entries[:num_tokens]:
            child.logprobs.append(self._logprob_entry(step))
            assert child.cumulative_logprob is not None
            child.cumulative_logprob += step.logprobs[0]

    def _logprob_entry(self, step: Logprobs) -> dict[int, Logprob]:
        """One position's token id -> Logprob: the chosen (sampled or prompt) token first."""
        entry: dict[int, Logprob] = {}
        for rank_index, (token_id, value) in enumerate(zip(step.token_ids, step.logprobs)):
            rank = step.sampled_rank if rank_index == 0 else rank_index
            if token_id not in entry:
                text = None
                if self.tokenizer is not None:
                    text = self.tokenizer.decode([token_id], skip_special_tokens=False)
                entry[token_id] = Logprob(value, rank, text)
        return entry

    def _make_output(self, parent: _ParentState, now: float) -> RequestOutput:
        finished = parent.finished
        if finished:
            parent.metrics.finished_time = now
            parent.metrics.num_generation_tokens = [
                len(c.detokenizer.token_ids) for c in parent.children.values()
            ]
            del self._parents[parent.request_id]
            for child_id in parent.children:
                self._parent_of.pop(child_id, None)
        delta = parent.output_kind is RequestOutputKind.DELTA
        prompt_logprobs = parent.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = None if parent.prompt_logprobs_sent else prompt_logprobs
            parent.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt.text,
            prompt_token_ids=parent.prompt.token_ids,
            outputs=[
                self._completion(child, delta, finished) for child in parent.children.values()
            ],
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
            prompt_logprobs=prompt_logprobs,
            lora_request=parent.lora_request,
        )

    @staticmethod
    def _completion(child: _ChildState, delta: bool, forgotten: bool) -> CompletionOutput:
        """What is new since the previous output (`delta`), else everything; the lists of a
        request already forgotten here are handed over, not copied."""
        token_ids, logprobs = child.detokenizer.token_ids, child.logprobs
        if delta:
            start, child.num_sent_tokens = child.num_sent_tokens, len(token_ids)
            token_ids = token_ids[start:]
            logprobs = logprobs[start:] if logprobs is not None else None
        elif not forgotten:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        text = child.detokenizer.get_next_output_text(child.finish_reason is not None, delta)
        return CompletionOutput(
            index=child.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=child.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
        )
