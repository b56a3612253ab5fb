"""The synchronous front end: text in, RequestOutputs out, over an in-process EngineCore.

Structured outputs: the front end and the core share the core's grammar manager, so a grammar
compiles once; `add_request` waits for it (at most the compile timeout) and raises ValueError for
a bad grammar before anything is queued.
"""

from __future__ import annotations

import contextlib
import itertools

from ferrum.config import EngineConfig
from ferrum.engine.arg_utils import EngineArgs
from ferrum.engine.core import EngineCore
from ferrum.engine.core_messages import SchedulerStats
from ferrum.engine.input_processor import InputProcessor, PromptType, load_tokenizer
from ferrum.engine.output_processor import OutputProcessor
from ferrum.outputs import RequestOutput
from ferrum.request import RequestStatus
from ferrum.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config)
        self.core = EngineCore(config)
        self.input_processor = InputProcessor(
            config.model_config, self.tokenizer, self.core.kv_cache_manager.max_tokens_in_pool()
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Stops the executor (its worker processes, bounded) and the grammar compiler threads;
        the engine serves no more. Safe to call twice."""
        self.core.shutdown()
        self.core.grammars.shutdown()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def start_grammar_compile(self, params: SamplingParams) -> None:
        """Starts compiling `params`' grammar (if any) without waiting: callers adding many
        requests start every compile first, so the compiles run in parallel. Errors are left
        for `add_request` to raise."""
        if params.structured_outputs is not None and self.tokenizer is not None:
            with contextlib.suppress(ValueError):
                self.core.grammars.submit(params.structured_outputs)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues one request (n completions); on error nothing is queued."""
        prompt, requests = self.input_processor.process(request_id, prompt, params, arrival_time)
        if params.structured_outputs is not None:
            self.core.grammars.compile(params.structured_outputs)
        self.output_processor.add_request(request_id, prompt, requests)
        for request in requests:
            self.core.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Aborts requests (unknown ids are ignored); their KV blocks return to the pool now."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for request_id in request_ids:
            self.core.finish_requests(self.output_processor.child_ids(request_id))
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the outputs of the requests that advanced (as their
        SamplingParams.output_kind asks)."""
        outputs, stopped = self.output_processor.process(self.core.step())
        if stopped:
            self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
