"""Turns per-step token updates into RequestOutputs: detokenization, stop strings, logprobs, n.

A user request with `n > 1` runs as n child requests in the scheduler; their outputs are gathered
here under the parent's id, in index order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ferrum.engine.core_output import EngineCoreOutput
from ferrum.engine.detokenizer import IncrementalDetokenizer
from ferrum.engine.tokenizer import Tokenizer
from ferrum.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ferrum.sampling_params import SamplingParams
from ferrum.scheduler.output import Logprobs


@dataclass
class _ChildState:
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, _ChildState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}#{request_id}"


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, final_only: bool = False) -> None:
        """`final_only`: return a request's output once, when it finishes (offline batches);
        otherwise after every step that advanced it (streaming)."""
        self.tokenizer = tokenizer
        self.final_only = final_only
        self._parents: dict[str, _ParentState] = {}
        self._parent_of: dict[str, _ParentState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        child_params: dict[str, SamplingParams],
        arrival_time: float,
    ) -> None:
        children = {}
        for index, (child_id, params) in enumerate(child_params.items()):
            detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params)
            child = _ChildState(index=index, params=params, detokenizer=detokenizer)
            if params.logprobs is not None:
                child.logprobs, child.cumulative_logprob = [], 0.0
            children[child_id] = child
        parent = _ParentState(
            request_id, prompt, prompt_token_ids, children, RequestMetrics(arrival_time)
        )
        self._parents[request_id] = parent
        for child_id in children:
            self._parent_of[child_id] = parent

    def has_request(self, request_id: str) -> bool:
        """Whether the id is taken, as a request's or as one of its completions' internal id."""
        return request_id in self._parents or request_id in self._parent_of

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
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.num_cached_tokens = max(parent.num_cached_tokens, core_output.num_cached_tokens)
            child.token_ids.extend(core_output.new_token_ids)
            self._add_logprobs(child, core_output.logprobs)
            stop_terminated = core_output.finish_reason == "stop"
            stop_string = child.detokenizer.update(core_output.new_token_ids, stop_terminated)
            if stop_string is not None:
                # A stop string wins over the core's reason for the same token (e.g. "length").
                child.finish_reason, child.stop_reason = "stop", stop_string
                if not core_output.finished:
                    stopped_by_string.append(core_output.req_id)
            elif core_output.finished:
                child.finish_reason = core_output.finish_reason
                child.stop_reason = core_output.stop_reason
            changed[parent.request_id] = parent
        outputs = [
            self._make_output(parent, now)
            for parent in changed.values()
            if parent.finished or not self.final_only
        ]
        return outputs, stopped_by_string

    def abort(self, request_id: str) -> RequestOutput | None:
        """Marks every unfinished child aborted and returns the final output."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children.values():
            if child.finish_reason is None:
                child.finish_reason = "abort"
        return self._make_output(parent, time.monotonic())

    def _add_logprobs(self, child: _ChildState, step: Logprobs | None) -> None:
        if child.logprobs is None or step is None:
            return
        entry: dict[int, Logprob] = {}
        for rank_index, (token_id, value) in enumerate(zip(step.token_ids, step.logprobs)):
            if rank_index == 0:
                rank = step.sampled_rank
            else:
                rank = rank_index
            if token_id not in entry:
                entry[token_id] = Logprob(value, rank, self._decode_one(token_id))
        child.logprobs.append(entry)
        assert child.cumulative_logprob is not None
        child.cumulative_logprob += step.logprobs[0]

    def _decode_one(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(self, parent: _ParentState, now: float) -> RequestOutput:
        finished = parent.finished
        if finished:
            parent.metrics.finished_time = now
            del self._parents[parent.request_id]
            for child_id in parent.children:
                self._parent_of.pop(child_id, None)
        completions = [
            CompletionOutput(
                index=child.index,
                text=child.detokenizer.get_next_output_text(
                    finished=child.finish_reason is not None, delta=False
                ),
                token_ids=list(child.token_ids),
                cumulative_logprob=child.cumulative_logprob,
                logprobs=list(child.logprobs) if child.logprobs is not None else None,
                finish_reason=child.finish_reason,
                stop_reason=child.stop_reason,
            )
            for child in parent.children.values()
        ]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics,
        )
