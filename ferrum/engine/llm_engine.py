"""The synchronous front end: text in, RequestOutputs out, over an in-process EngineCore."""

from __future__ import annotations

import itertools
import time

from ferrum.config import EngineConfig
from ferrum.engine.arg_utils import EngineArgs
from ferrum.engine.core import EngineCore
from ferrum.engine.core_output import SchedulerStats
from ferrum.engine.input_processor import InputProcessor, PromptType
from ferrum.engine.output_processor import OutputProcessor, child_request_id
from ferrum.engine.request import Request, RequestStatus
from ferrum.engine.tokenizer import Tokenizer
from ferrum.outputs import RequestOutput
from ferrum.sampling_params import SamplingParams


def load_tokenizer(config: EngineConfig) -> Tokenizer | None:
    model_config = config.model_config
    if model_config.skip_tokenizer_init:
        return None
    return Tokenizer.from_pretrained(model_config.tokenizer)


def resolve_eos_token_ids(config: EngineConfig, tokenizer: Tokenizer | None) -> list[int]:
    """The tokenizer's EOS first, then generation_config.json's others."""
    ids = config.model_config.eos_token_ids()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id] + [i for i in ids if i != tokenizer.eos_token_id]
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig, final_outputs_only: bool = False) -> None:
        """`final_outputs_only`: step() returns a request's output only when it finishes."""
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.core = EngineCore(config)
        self.input_processor = InputProcessor(
            self.tokenizer,
            config.model_config.vocab_size,
            config.model_config.max_model_len,
            self.core.kv_cache_manager.max_tokens_in_pool(),
            resolve_eos_token_ids(config, self.tokenizer),
        )
        self.output_processor = OutputProcessor(self.tokenizer, final_outputs_only)
        self._request_counter = itertools.count()

    @classmethod
    def from_engine_args(
        cls, engine_args: EngineArgs, final_outputs_only: bool = False
    ) -> LLMEngine:
        return cls(engine_args.create_engine_config(), final_outputs_only)

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        """Validates and queues one request (n completions); on error nothing is queued."""
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = self.input_processor.process_prompt(prompt)
        params = self.input_processor.resolve_params(params, len(token_ids))
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        children = {
            child_request_id(request_id, index, params.n): child
            for index, child in enumerate(self.input_processor.child_params(params))
        }
        taken = next((c for c in children if self.output_processor.has_request(c)), None)
        if taken is not None:
            raise ValueError(f"request_id {request_id!r} collides with request {taken!r}")
        self.output_processor.add_request(request_id, text, token_ids, children, arrival_time)
        eos = self.input_processor.eos_for(params)
        for child_id, child in children.items():
            self.core.add_request(Request(child_id, token_ids, child, eos, arrival_time))

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
        """Runs one engine step; returns the outputs of the requests that advanced."""
        outputs, stopped = self.output_processor.process(self.core.step())
        if stopped:
            self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
